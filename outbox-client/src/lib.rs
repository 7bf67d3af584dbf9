//! Write outbox messages inside your own Postgres transaction.
//!
//! A service that commits a row and then publishes an event loses the event if it
//! crashes in between, and sends it twice if it retries after a publish that had
//! in fact succeeded. With an outbox the event is written as a row in the *same*
//! transaction as the domain change; the `outbox-relay` process publishes committed
//! rows at least once, each stamped with a stable [`MessageId`] that consumers
//! use to drop duplicates.
//!
//! ```no_run
//! # async fn example(client: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_client::Message;
//!
//! outbox_client::migrate(client, "outbox").await?; // once, at start-up
//!
//! let tx = client.transaction().await?;
//! tx.execute("UPDATE orders SET state = 'paid' WHERE id = $1", &[&42i64]).await?;
//! let id = outbox_client::enqueue(
//!     &tx,
//!     &Message::builder("orders")          // AMQP exchange or Kafka topic
//!         .key("order-42")                 // per-key order; Kafka record key
//!         .routing_key("orders.paid")
//!         .json(&serde_json::json!({"order": 42, "state": "paid"}))
//!         .build()?,
//! )
//! .await?;
//! tx.commit().await?; // the event exists if and only if the update does
//! println!("enqueued {id}");
//! # Ok(()) }
//! ```
//!
//! # Consumers and other duplicate runs
//!
//! The relay delivers at least once, so consumers must apply each message once:
//! [`inbox`] records the message id in the same transaction as the effect, and
//! [`consumer`] wires it to RabbitMQ and Kafka (features `amqp`, `kafka`). The
//! same idea covers resent webhooks, cron on several instances
//! ([`job_lock`]), notifications ([`send_once`]) and restarted long jobs
//! ([`checkpoint`]); [`defenses`] maps each source of duplicates to its defense.
//!
//! # Features
//!
//! - `idempotency`: [`idempotency`], idempotency keys for HTTP endpoints, recorded
//!   in the same transaction as the request's effect and its outbox messages.
//! - `axum`: the `idempotency::axum` extractor and response helper (implies
//!   `idempotency`).
//! - `sqlx`: [`sqlx`](crate::sqlx), `enqueue` and `enqueue_batch` in an sqlx
//!   transaction or connection, with the same messages, checks and rows.
//! - `opentelemetry`: [`trace`], the enqueueing span's W3C `traceparent` and
//!   `tracestate` stored in each message's headers, so consumers continue the
//!   trace.
//!
//! # Ordering
//!
//! Messages that share a key are published in the order of their outbox `seq`,
//! which is the order they were inserted. That equals commit order when the
//! writers of one key serialize, for example by locking the aggregate's row
//! (`SELECT ... FOR UPDATE`) *before* enqueueing. Two transactions that insert
//! for the same key concurrently have no defined order between them.
#![warn(missing_docs, unreachable_pub)]

pub mod checkpoint;
pub mod consumer;
pub mod defenses;
mod error;
#[cfg(feature = "idempotency")]
pub mod idempotency;
pub mod inbox;
pub mod job_lock;
mod message;
mod migrate;
mod rows;
mod schema;
pub mod send_once;
pub mod session;
#[cfg(feature = "sqlx")]
pub mod sqlx;
pub mod trace;

use tokio_postgres::GenericClient;

use rows::Rows;

pub use error::{BoxError, Error, MessageIdOrBatch};
pub use message::{Message, MessageBuilder, MessageId, RESERVED_HEADERS};
#[cfg(feature = "migrate")]
pub use migrate::migrate;
pub use migrate::set_notify;
pub use schema::SchemaName;

/// Default payload limit: 960 KiB (983,040 bytes), so that every message the
/// client accepts fits both brokers untuned. librdkafka refuses a record over
/// its `message.max.bytes` (1,000,000 by default) and a Kafka broker one over
/// 1,048,588; the 16 KiB between this limit and librdkafka's leave room for
/// the key and headers. RabbitMQ takes up to 128 MiB. To raise it, raise
/// `message.max.bytes` on the relay's producer (`--kafka-config`) and the
/// topic's `max.message.bytes` first; a message over the broker's limit goes
/// to the dead letters.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 960 * 1024;

/// The longest ordering key the outbox takes: 2,048 bytes of UTF-8. The key
/// is indexed with the row's seq, and a Postgres btree entry holds at most
/// 2,704 bytes of a value that does not compress, so a longer limit would let
/// some keys through and refuse others of the same length. Migration V18
/// holds `enqueue()` and plain INSERTs to the same limit.
pub const MAX_ORDERING_KEY_BYTES: usize = 2048;

/// The longest key the consumer-side tables take, in bytes of UTF-8: a
/// consumer name and a message id in the inbox, a checkpoint's job name, a
/// send-once notification's recipient, kind and period. Each table indexes
/// its keys together, and a Postgres btree entry holds at most 2,704 bytes
/// of keys that do not compress; three keys of 512 bytes leave room. The
/// consumers settle a delivered message id over the limit like a missing
/// one (it cannot be recorded).
pub const MAX_KEY_BYTES: usize = 512;

/// Writes messages to one outbox schema. Cheap to clone; build one at start-up.
#[derive(Debug, Clone)]
pub struct Outbox {
    schema: SchemaName,
    max_payload_bytes: usize,
    inserts: rows::Inserts,
}

impl Default for Outbox {
    fn default() -> Self {
        Outbox::with_schema(SchemaName::default())
    }
}

impl Outbox {
    /// An outbox in schema `schema`, validated as an identifier.
    pub fn new(schema: &str) -> Result<Self, Error> {
        Ok(Outbox::with_schema(SchemaName::new(schema)?))
    }

    /// An outbox in an already validated schema.
    pub fn with_schema(schema: SchemaName) -> Self {
        Outbox {
            inserts: rows::Inserts::new(&schema),
            schema,
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
        }
    }

    /// Rejects payloads larger than `bytes` before anything is written.
    pub fn max_payload_bytes(mut self, bytes: usize) -> Self {
        self.max_payload_bytes = bytes;
        self
    }

    /// The schema this outbox writes to.
    pub fn schema(&self) -> &SchemaName {
        &self.schema
    }

    /// Writes one message as part of `client`'s transaction and returns its id.
    ///
    /// Pass a [`tokio_postgres::Transaction`] so the message commits or rolls back
    /// with the caller's own rows. Validation errors are raised before any SQL is
    /// sent; a database error aborts the transaction as any failed statement does.
    pub async fn enqueue(
        &self,
        client: &impl GenericClient,
        message: &Message,
    ) -> Result<MessageId, Error> {
        let id = message.message_id.unwrap_or_else(MessageId::new_v7);
        self.write(client, std::slice::from_ref(message), &[id])
            .await
            .map_err(|e| rows::name_duplicate(e, id))?;
        Ok(id)
    }

    /// Writes all `messages` in one statement (one round trip) and returns their
    /// ids in order. Every message is validated first; if one is invalid, none is
    /// written.
    pub async fn enqueue_batch(
        &self,
        client: &impl GenericClient,
        messages: &[Message],
    ) -> Result<Vec<MessageId>, Error> {
        let ids = rows::ids(messages);
        self.write(client, messages, &ids).await?;
        Ok(ids)
    }

    async fn write(
        &self,
        client: &impl GenericClient,
        messages: &[Message],
        ids: &[MessageId],
    ) -> Result<(), Error> {
        if messages.is_empty() {
            return Ok(());
        }
        let rows = Rows::new(messages, ids, self.max_payload_bytes)?;
        let columns: [&(dyn tokio_postgres::types::ToSql + Sync); 7] = [
            &rows.ids,
            &rows.destinations,
            &rows.keys,
            &rows.routing_keys,
            &rows.headers,
            &rows.payloads,
            &rows.content_types,
        ];
        let sql = self.inserts.of(&rows);
        let result = match &rows.event_types {
            None => client.execute(sql, &columns).await,
            Some(types) => {
                let mut typed = columns.to_vec();
                typed.push(types);
                client.execute(sql, &typed).await
            }
        };
        let written = result.map_err(|e| Error::from_db(&self.schema, e))?;
        rows::check_written(&rows, written)
    }
}

/// [`Outbox::enqueue`] on the default schema (`outbox`) and payload limit.
pub async fn enqueue(client: &impl GenericClient, message: &Message) -> Result<MessageId, Error> {
    Outbox::default().enqueue(client, message).await
}

/// [`Outbox::enqueue_batch`] on the default schema (`outbox`) and payload limit.
pub async fn enqueue_batch(
    client: &impl GenericClient,
    messages: &[Message],
) -> Result<Vec<MessageId>, Error> {
    Outbox::default().enqueue_batch(client, messages).await
}
