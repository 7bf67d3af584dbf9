//! Where duplicate runs come from, and the defense this crate offers for each.
//!
//! Infrastructure repeats work on purpose. A sender can only choose between *at
//! most once* (may lose) and *at least once* (may repeat); queues, webhook
//! providers and retrying clients choose the second, so the receiving side has
//! to make a repeat harmless. The hard case is the timeout that succeeded: the
//! work was done, the answer arrived late, and the retry does it again.
//!
//! Every defense below is the same idea: a key that names the unit of work, a
//! unique constraint on it, and the record written in the **same transaction**
//! as the effect. Never `SELECT` then `INSERT` (two workers both see nothing),
//! never record after an external side effect without deciding that a repeat is
//! acceptable.
//!
//! | source of duplicates              | defense                                             | API                                              |
//! |-----------------------------------|-----------------------------------------------------|--------------------------------------------------|
//! | double click, client retry after a timeout | idempotency key passed end to end          | `outbox_client::idempotency`                    |
//! | queue redelivery (at least once)  | inbox: message id recorded with the effect          | [`inbox::process_once`], [`consumer::amqp`], [`consumer::kafka`] |
//! | webhook resent by the provider    | inbox keyed by the provider's event id; 200 for a duplicate | [`inbox::process_once`], `examples/webhook.rs` |
//! | cron firing on N instances        | session advisory lock on a dedicated connection     | [`job_lock::run_exclusive`]                      |
//! | notification retried              | (recipient, kind, period) record, order chosen explicitly | [`send_once::SendOnce::send`]              |
//! | long job killed and restarted     | batches in key order, checkpoint saved with each batch | [`checkpoint::Checkpoint`]                    |
//!
//! [`inbox::process_once`]: crate::inbox::process_once
//! [`consumer::amqp`]: crate::consumer
//! [`consumer::kafka`]: crate::consumer
//! [`job_lock::run_exclusive`]: crate::job_lock::run_exclusive
//! [`send_once::SendOnce::send`]: crate::send_once::SendOnce::send
//! [`checkpoint::Checkpoint`]: crate::checkpoint::Checkpoint
//!
//! The RabbitMQ and Kafka helpers need the cargo features `amqp` and `kafka`.
//!
//! # Double click and client retry
//!
//! The request carries a client-generated idempotency key; the server stores it
//! with the response in the transaction that does the work and answers a repeat
//! from the store. That lives in the `outbox_client::idempotency` module.
//!
//! # Queue redelivery
//!
//! ```no_run
//! # async fn f(client: &mut tokio_postgres::Client, message_id: &str) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_client::inbox::{self, Arrival};
//!
//! let tx = client.transaction().await?;
//! if inbox::process_once(&tx, "billing", message_id).await? == Arrival::New {
//!     tx.execute("UPDATE accounts SET credits = credits + 100 WHERE id = 7", &[]).await?;
//! }
//! tx.commit().await?;
//! // then ack, for a duplicate too
//! # Ok(()) }
//! ```
//!
//! # Resent webhook
//!
//! Same inbox, keyed by the provider's event id (`evt_...`). A recognized
//! duplicate is a success: answer 200, or the provider keeps resending.
//!
//! ```no_run
//! # async fn f(client: &mut tokio_postgres::Client, event_id: &str) -> Result<u16, Box<dyn std::error::Error>> {
//! use outbox_client::inbox::{self, Arrival};
//!
//! let tx = client.transaction().await?;
//! if inbox::process_once(&tx, "stripe-webhook", event_id).await? == Arrival::New {
//!     tx.execute("UPDATE orders SET state = 'paid' WHERE id = 42", &[]).await?;
//! }
//! tx.commit().await?;
//! Ok(200) // new or duplicate alike
//! # }
//! ```
//!
//! # Cron on N instances
//!
//! ```no_run
//! # async fn report() {}
//! # async fn f(config: &tokio_postgres::Config) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_client::job_lock::{run_exclusive, Exclusive};
//!
//! if let Exclusive::Busy = run_exclusive(config, "weekly-report", |_| report()).await? {
//!     // another instance has it
//! }
//! # Ok(()) }
//! ```
//!
//! # Notifications
//!
//! ```no_run
//! # async fn email() -> Result<(), std::io::Error> { Ok(()) }
//! # async fn f(client: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_client::send_once::{Notification, Order, SendOnce};
//!
//! let report = Notification::new("user-42", "weekly_report", "2026-W42")?;
//! SendOnce::default()
//!     .send(client, &report, Order::SendThenRecord, email) // email: a duplicate beats a loss
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! # Long job restarted
//!
//! ```no_run
//! # async fn f(client: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_client::checkpoint::Checkpoint;
//!
//! let job = Checkpoint::new(Default::default(), "recalc-stats")?;
//! let batch = job.begin(client).await?;
//! // select rows with id > batch.after(), apply the effect via batch.transaction()
//! batch.commit(1000).await?; // the effect and the new position, together
//! # Ok(()) }
//! ```
