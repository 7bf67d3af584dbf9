//! Send a notification once per (recipient, kind, period).
//!
//! An email or SMS leaves the database: it cannot join a transaction, so the
//! record of it and the send can never be atomic. What remains is a choice of
//! order, and each order fails differently when the process dies in between:
//!
//! | order                        | crash between record and send | use for                         |
//! |------------------------------|-------------------------------|---------------------------------|
//! | [`Order::RecordThenSend`]    | never sent (**lost**)         | money, anything not to repeat   |
//! | [`Order::SendThenRecord`]    | sent again on retry (**dup**) | email: a rare duplicate is fine |
//!
//! There is no default: the caller names the order. A welcome email sent twice is
//! an annoyance; a payout or a gift card sent twice is a loss, and one sent zero
//! times can be found and fixed: record-then-send leaves the row of an
//! unconfirmed send behind ([`SendOnce::unconfirmed`]) for reconciliation.
//!
//! Concurrent attempts are serialized by the primary key in both orders: only one
//! of them calls `send`.
//!
//! ```no_run
//! # async fn mail(to: &str) -> Result<(), std::io::Error> { Ok(()) }
//! # async fn example(client: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_client::send_once::{Notification, Order, SendOnce, Sent};
//!
//! let notifications = SendOnce::default();
//! let welcome = Notification::new("user-42", "welcome", "once")?;
//! match notifications
//!     .send(client, &welcome, Order::SendThenRecord, || mail("ada@example.com"))
//!     .await?
//! {
//!     Sent::Sent => {}
//!     Sent::AlreadySent => {} // an earlier or concurrent attempt sent it
//! }
//! # Ok(()) }
//! ```

use std::future::Future;
use std::time::Duration;

use tokio_postgres::{Client, GenericClient};

use crate::inbox::check_key;
use crate::{Error, SchemaName};

/// Which comes first, the record or the send. See the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// Record and commit, then send: at most once. A crash or a failed send
    /// after the record means the notification is never sent by a retry; the
    /// record stays unconfirmed. For money and anything that must not repeat.
    RecordThenSend,
    /// Send, then commit the record: at least once. The record is written in a
    /// transaction held open across the send (which blocks concurrent attempts)
    /// and committed after it; a crash in between sends it again on retry. For
    /// email and other notifications where a rare duplicate beats a lost one.
    SendThenRecord,
}

/// The outcome of [`SendOnce::send`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sent {
    /// `send` was called and succeeded.
    Sent,
    /// A record already existed (or a concurrent attempt committed one first):
    /// `send` was not called.
    AlreadySent,
}

/// What failed in [`SendOnce::send`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SendOnceError<E> {
    /// Writing or committing the record failed. With
    /// [`Order::SendThenRecord`] after a successful send, the notification went
    /// out but is not recorded: a retry sends it again.
    #[error("could not record the notification")]
    Record(#[source] Error),
    /// `send` failed. With [`Order::RecordThenSend`] the record stays, so a
    /// retry will not send; call [`SendOnce::forget`] if the send certainly did
    /// not happen. With [`Order::SendThenRecord`] nothing was recorded.
    #[error("sending the notification failed")]
    Send(#[source] E),
    /// [`Order::RecordThenSend`]: the notification was sent, but marking it
    /// confirmed failed. It will not be sent again; it is listed by
    /// [`SendOnce::unconfirmed`].
    #[error("notification sent, but its confirmation could not be saved")]
    Unconfirmed(#[source] Error),
}

/// The key of one notification: who gets it, what it is, and for which period
/// (`"once"`, `"2026-W42"`, an order id).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Notification {
    recipient: String,
    kind: String,
    period: String,
}

impl Notification {
    /// The key (recipient, kind, period); none may be empty.
    pub fn new(
        recipient: impl Into<String>,
        kind: impl Into<String>,
        period: impl Into<String>,
    ) -> Result<Self, Error> {
        let n = Notification {
            recipient: recipient.into(),
            kind: kind.into(),
            period: period.into(),
        };
        check_key("notification recipient", &n.recipient)?;
        check_key("notification kind", &n.kind)?;
        check_key("notification period", &n.period)?;
        Ok(n)
    }

    /// The recipient.
    pub fn recipient(&self) -> &str {
        &self.recipient
    }

    /// The kind.
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// The period.
    pub fn period(&self) -> &str {
        &self.period
    }
}

/// The sent-notifications record of one schema.
#[derive(Debug, Clone)]
pub struct SendOnce {
    schema: SchemaName,
    table: String,
}

impl Default for SendOnce {
    fn default() -> Self {
        SendOnce::with_schema(SchemaName::default())
    }
}

impl SendOnce {
    /// The record in schema `schema`, validated as an identifier.
    pub fn new(schema: &str) -> Result<Self, Error> {
        Ok(SendOnce::with_schema(SchemaName::new(schema)?))
    }

    /// The record in an already validated schema.
    pub fn with_schema(schema: SchemaName) -> Self {
        SendOnce {
            table: format!("{}.sent_notifications", schema.quoted()),
            schema,
        }
    }

    /// Sends `notification` with `send` unless it is already recorded, in the
    /// given `order`.
    ///
    /// With [`Order::SendThenRecord`] a transaction on `client` stays open while
    /// `send` runs: give `send` a timeout.
    pub async fn send<F, Fut, E>(
        &self,
        client: &mut Client,
        notification: &Notification,
        order: Order,
        send: F,
    ) -> Result<Sent, SendOnceError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<(), E>>,
    {
        let n = notification;
        let db = |e| SendOnceError::Record(Error::from_db_no_conflict(&self.schema, e));
        match order {
            Order::RecordThenSend => {
                let recorded = client
                    .execute(
                        &format!(
                            "INSERT INTO {} (recipient, kind, period) VALUES ($1, $2, $3) \
                             ON CONFLICT DO NOTHING",
                            self.table
                        ),
                        &[&n.recipient, &n.kind, &n.period],
                    )
                    .await
                    .map_err(db)?;
                if recorded == 0 {
                    return Ok(Sent::AlreadySent);
                }
                send().await.map_err(SendOnceError::Send)?;
                client
                    .execute(
                        &format!(
                            "UPDATE {} SET sent_at = now() \
                             WHERE recipient = $1 AND kind = $2 AND period = $3",
                            self.table
                        ),
                        &[&n.recipient, &n.kind, &n.period],
                    )
                    .await
                    .map_err(|e| {
                        SendOnceError::Unconfirmed(Error::from_db_no_conflict(&self.schema, e))
                    })?;
                Ok(Sent::Sent)
            }
            Order::SendThenRecord => {
                let tx = client.transaction().await.map_err(db)?;
                // The transaction sits idle while `send` runs: a server that
                // ends such sessions (`idle_in_transaction_session_timeout`)
                // would free the key mid-send, and a waiting attempt would
                // send too.
                tx.batch_execute("SET LOCAL idle_in_transaction_session_timeout = 0")
                    .await
                    .map_err(db)?;
                // The uncommitted row holds the key: a concurrent attempt waits
                // here until this one commits (then finds it) or rolls back.
                let recorded = tx
                    .execute(
                        &format!(
                            "INSERT INTO {} (recipient, kind, period, sent_at) \
                             VALUES ($1, $2, $3, now()) ON CONFLICT DO NOTHING",
                            self.table
                        ),
                        &[&n.recipient, &n.kind, &n.period],
                    )
                    .await
                    .map_err(db)?;
                if recorded == 0 {
                    return Ok(Sent::AlreadySent);
                }
                // A failed send drops `tx`, rolling the record back.
                send().await.map_err(SendOnceError::Send)?;
                tx.commit().await.map_err(db)?;
                Ok(Sent::Sent)
            }
        }
    }

    /// Deletes the record of `notification`, so the next [`SendOnce::send`]
    /// sends it. For a record-then-send attempt whose send is known not to have
    /// happened (the provider refused it).
    pub async fn forget(
        &self,
        client: &impl GenericClient,
        notification: &Notification,
    ) -> Result<bool, Error> {
        let n = notification;
        client
            .execute(
                &format!(
                    "DELETE FROM {} WHERE recipient = $1 AND kind = $2 AND period = $3",
                    self.table
                ),
                &[&n.recipient, &n.kind, &n.period],
            )
            .await
            .map(|deleted| deleted > 0)
            .map_err(|e| Error::from_db_no_conflict(&self.schema, e))
    }

    /// Record-then-send attempts recorded more than `older_than` ago whose send
    /// was never confirmed: each was sent zero times or once, and only the
    /// provider's own log can tell which.
    pub async fn unconfirmed(
        &self,
        client: &impl GenericClient,
        older_than: Duration,
    ) -> Result<Vec<Notification>, Error> {
        let rows = client
            .query(
                &format!(
                    "SELECT recipient, kind, period FROM {} \
                     WHERE sent_at IS NULL AND recorded_at < now() - make_interval(secs => $1) \
                     ORDER BY recorded_at",
                    self.table
                ),
                &[&older_than.as_secs_f64()],
            )
            .await
            .map_err(|e| Error::from_db_no_conflict(&self.schema, e))?;
        Ok(rows
            .iter()
            .map(|r| Notification {
                recipient: r.get(0),
                kind: r.get(1),
                period: r.get(2),
            })
            .collect())
    }
}
