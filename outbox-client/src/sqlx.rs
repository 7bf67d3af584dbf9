//! Enqueue through [sqlx](https://docs.rs/sqlx) (feature `sqlx`), in the
//! application's own `sqlx::Transaction<Postgres>` or on a `&mut PgConnection`.
//!
//! The same [`Message`], the same checks, the same errors and the same rows as
//! the tokio-postgres path: both build their statement from one place.
//!
//! ```no_run
//! # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_client::Message;
//!
//! let mut tx = pool.begin().await?;
//! sqlx::query("UPDATE orders SET state = 'paid' WHERE id = $1")
//!     .bind(42i64)
//!     .execute(&mut *tx)
//!     .await?;
//! let id = outbox_client::sqlx::enqueue(
//!     &mut tx,
//!     &Message::builder("orders").key("order-42").json(&serde_json::json!({"order": 42})).build()?,
//! )
//! .await?;
//! tx.commit().await?;
//! # let _ = id; Ok(()) }
//! ```
//!
//! Migrations still run through tokio-postgres ([`crate::migrate`]) or
//! `outbox-relay migrate`; sqlx's own migrator does not know this schema.

use ::sqlx::PgConnection;

use crate::rows::{self, Rows};
use crate::{Error, Message, MessageId, Outbox};

impl Outbox {
    /// [`Outbox::enqueue`] on an sqlx connection or transaction (`&mut tx`).
    pub async fn enqueue_sqlx(
        &self,
        conn: &mut PgConnection,
        message: &Message,
    ) -> Result<MessageId, Error> {
        let id = message.message_id.unwrap_or_else(MessageId::new_v7);
        self.write_sqlx(conn, std::slice::from_ref(message), &[id])
            .await
            .map_err(|e| rows::name_duplicate(e, id))?;
        Ok(id)
    }

    /// [`Outbox::enqueue_batch`] on an sqlx connection or transaction.
    pub async fn enqueue_batch_sqlx(
        &self,
        conn: &mut PgConnection,
        messages: &[Message],
    ) -> Result<Vec<MessageId>, Error> {
        let ids = rows::ids(messages);
        self.write_sqlx(conn, messages, &ids).await?;
        Ok(ids)
    }

    async fn write_sqlx(
        &self,
        conn: &mut PgConnection,
        messages: &[Message],
        ids: &[MessageId],
    ) -> Result<(), Error> {
        if messages.is_empty() {
            return Ok(());
        }
        let rows = Rows::new(messages, ids, self.max_payload_bytes)?;
        let sql = self.inserts.of(&rows);
        let mut query = ::sqlx::query(sql)
            .bind(&rows.ids)
            .bind(&rows.destinations)
            .bind(&rows.keys)
            .bind(&rows.routing_keys)
            .bind(&rows.headers)
            .bind(&rows.payloads)
            .bind(&rows.content_types);
        if let Some(types) = &rows.event_types {
            query = query.bind(types);
        }
        let written = query
            .execute(conn)
            .await
            .map_err(|e| Error::from_sqlx(&self.schema, e))?
            .rows_affected();
        rows::check_written(&rows, written)
    }
}

/// [`Outbox::enqueue_sqlx`] on the default schema (`outbox`) and payload limit.
pub async fn enqueue(conn: &mut PgConnection, message: &Message) -> Result<MessageId, Error> {
    Outbox::default().enqueue_sqlx(conn, message).await
}

/// [`Outbox::enqueue_batch_sqlx`] on the default schema (`outbox`) and payload
/// limit.
pub async fn enqueue_batch(
    conn: &mut PgConnection,
    messages: &[Message],
) -> Result<Vec<MessageId>, Error> {
    Outbox::default().enqueue_batch_sqlx(conn, messages).await
}
