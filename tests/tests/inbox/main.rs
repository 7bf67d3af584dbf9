//! The inbox and the consumer helpers built on it, against real Postgres,
//! RabbitMQ and (for the Kafka test) a Kafka-protocol broker: the check in the
//! caller's transaction and its retention, one message delivered many times to
//! concurrent consumers, a consumer that crashes between committing its effect
//! and acking (AMQP) or committing the offset (Kafka), a failing handler, and a
//! delivery without a message id.

use std::time::Duration;

use outbox_tests::db::TestDb;
use tokio_postgres::Transaction;

mod amqp;
mod check;
mod kafka;

/// A ceiling on waits, never a claim about speed.
const PATIENCE: Duration = Duration::from_secs(120);

/// `schema.effects`: one counter per message, incremented by the handlers. A
/// value above 1 is an effect applied twice.
async fn create_effects(db: &TestDb) -> String {
    let t = format!("{}.effects", db.schema.quoted());
    db.client
        .batch_execute(&format!(
            "CREATE TABLE {t} (message text PRIMARY KEY, applied int NOT NULL)"
        ))
        .await
        .expect("create effects");
    t
}

async fn applied(db: &TestDb, table: &str, message: &str) -> i32 {
    db.client
        .query_opt(
            &format!("SELECT applied FROM {table} WHERE message = $1"),
            &[&message],
        )
        .await
        .expect("read effect")
        .map(|r| r.get(0))
        .unwrap_or(0)
}

/// Adds one to `message`'s counter in `table` (made by [`create_effects`]),
/// in the handler's transaction: what both brokers' handlers apply.
async fn apply_effect(
    tx: &Transaction<'_>,
    table: &str,
    message: &str,
) -> Result<(), tokio_postgres::Error> {
    tx.execute(
        &format!(
            "INSERT INTO {table} (message, applied) VALUES ($1, 1) \
             ON CONFLICT (message) DO UPDATE SET applied = {table}.applied + 1"
        ),
        &[&message],
    )
    .await?;
    Ok(())
}
