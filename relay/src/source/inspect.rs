//! Read-only questions about an outbox, asked by both `outbox-relay status`
//! and the metrics collector, so each is written once.

use std::time::SystemTime;

use outbox_client::SchemaName;
use tokio_postgres::Client;

/// Waiting rows of one destination.
#[derive(Debug, Clone, PartialEq)]
pub struct Backlog {
    /// The destination (AMQP exchange or Kafka topic).
    pub destination: String,
    /// Rows waiting.
    pub pending: i64,
    /// When the oldest was written.
    pub oldest: Option<SystemTime>,
    /// Its age by the database's clock, in seconds.
    pub oldest_age_s: Option<f64>,
    /// Rows with at least one failed attempt.
    pub retrying: i64,
}

/// The backlog per destination, largest first.
pub async fn backlog(
    client: &Client,
    schema: &SchemaName,
) -> Result<Vec<Backlog>, tokio_postgres::Error> {
    let rows = client
        .query(
            &format!(
                "SELECT destination, count(*), min(created_at), \
                        extract(epoch FROM now() - min(created_at))::float8, \
                        count(*) FILTER (WHERE attempts > 0) \
                 FROM {}.messages GROUP BY destination ORDER BY count(*) DESC",
                schema.quoted()
            ),
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| Backlog {
            destination: r.get(0),
            pending: r.get(1),
            oldest: r.get(2),
            oldest_age_s: r.get(3),
            retrying: r.get(4),
        })
        .collect())
}

/// Messages in the dead letters.
pub async fn dead_letter_count(
    client: &Client,
    schema: &SchemaName,
) -> Result<i64, tokio_postgres::Error> {
    Ok(client
        .query_one(
            &format!("SELECT count(*) FROM {}.dead_letters", schema.quoted()),
            &[],
        )
        .await?
        .get(0))
}

/// A key whose later messages wait behind one of its dead letters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParkedKey {
    /// The ordering key.
    pub key: String,
    /// The (lowest) dead letter it waits behind.
    pub behind_dead_letter: String,
    /// Its messages waiting.
    pub waiting: i64,
}

/// The parked keys with the most waiting, at most `limit`.
pub async fn parked_keys(
    client: &Client,
    schema: &SchemaName,
    limit: i64,
) -> Result<Vec<ParkedKey>, tokio_postgres::Error> {
    let s = schema.quoted();
    let rows = client
        .query(
            &format!(
                "SELECT d.ordering_key, (array_agg(d.message_id::text ORDER BY d.seq))[1], \
                        count(DISTINCT m.seq) \
                 FROM {s}.dead_letters d JOIN {s}.messages m \
                   ON m.ordering_key = d.ordering_key AND m.seq > d.seq \
                 GROUP BY d.ordering_key ORDER BY 3 DESC LIMIT $1"
            ),
            &[&limit],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| ParkedKey {
            key: r.get(0),
            behind_dead_letter: r.get(1),
            waiting: r.get(2),
        })
        .collect())
}

/// How many keys are parked behind a dead letter.
pub async fn parked_key_count(
    client: &Client,
    schema: &SchemaName,
) -> Result<i64, tokio_postgres::Error> {
    let s = schema.quoted();
    Ok(client
        .query_one(
            &format!(
                "SELECT count(DISTINCT d.ordering_key) FROM {s}.dead_letters d \
                 WHERE EXISTS (SELECT 1 FROM {s}.messages m \
                               WHERE m.ordering_key = d.ordering_key AND m.seq > d.seq)"
            ),
            &[],
        )
        .await?
        .get(0))
}
