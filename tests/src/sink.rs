//! One broker-neutral face for the suites' independent consumers, so a
//! scenario is written once and run against RabbitMQ and Kafka alike.

use std::time::Duration;

use crate::check::{check, Report, Seen};
use crate::db::TestDb;
use crate::eventually;
use crate::kafka::Record;
use crate::workload::Written;

/// A destination on one broker and the consumer reading it.
pub enum Sink {
    /// A RabbitMQ exchange with a queue bound to everything.
    Amqp(crate::amqp::Fixture),
    /// A Kafka topic read from the beginning of every partition.
    Kafka {
        /// The consumer.
        fixture: crate::kafka::Fixture,
        /// The bootstrap servers the relay should use.
        brokers: String,
    },
}

/// Partitions of the topics the Kafka sinks create.
pub const KAFKA_PARTITIONS: i32 = 4;

impl Sink {
    /// A fresh exchange on the local RabbitMQ.
    pub async fn amqp() -> Sink {
        Sink::Amqp(crate::amqp::Fixture::new().await)
    }

    /// A fresh topic on the Kafka-protocol broker at `brokers`.
    pub async fn kafka(brokers: &str) -> Sink {
        Sink::Kafka {
            fixture: crate::kafka::Fixture::new(brokers, KAFKA_PARTITIONS).await,
            brokers: brokers.to_owned(),
        }
    }

    /// "amqp" or "kafka", for report lines.
    pub fn broker(&self) -> &'static str {
        match self {
            Sink::Amqp(_) => "amqp",
            Sink::Kafka { .. } => "kafka",
        }
    }

    /// The outbox destination that reaches this consumer.
    pub fn destination(&self) -> &str {
        match self {
            Sink::Amqp(f) => &f.exchange,
            Sink::Kafka { fixture, .. } => &fixture.topic,
        }
    }

    /// Deliveries so far.
    pub fn count(&self) -> usize {
        match self {
            Sink::Amqp(f) => f.count(),
            Sink::Kafka { fixture, .. } => fixture.count(),
        }
    }

    /// Deliveries so far, for the checker, in arrival order.
    pub fn seen(&self) -> Vec<Seen> {
        match self {
            Sink::Amqp(f) => crate::seen_amqp(&f.deliveries()),
            Sink::Kafka { fixture, .. } => {
                // In each partition's offset order: records read again after
                // the live consumer skipped them (see
                // `kafka::Fixture::read_skipped`) go where the broker put them.
                // That order holds a key's records only if the key lives in
                // one partition: a key spread over two would show just some
                // of its inversions.
                let mut records = fixture.records();
                let mut partition_of: std::collections::HashMap<&str, i32> =
                    std::collections::HashMap::new();
                for r in &records {
                    if let Some(key) = r.key.as_deref() {
                        let p = *partition_of.entry(key).or_insert(r.partition);
                        assert_eq!(
                            p, r.partition,
                            "key {key} is in partitions {p} and {}: its order cannot be read",
                            r.partition
                        );
                    }
                }
                records.sort_by_key(|r| (r.partition, r.offset));
                crate::seen_kafka(&records)
            }
        }
    }

    /// Waits up to `patience` for `db`'s outbox to drain and for this
    /// consumer to have seen every message `written` committed, lets late
    /// duplicates land, then checks what arrived against what was written.
    ///
    /// Waiting for a count would not do: duplicates make the count reach the
    /// number committed while a first delivery is still on its way. When
    /// something is still missing at the end, what the outbox, its dead
    /// letters, its retained receipts and the consumer know of it is printed,
    /// so a failure says where the message went.
    pub async fn settle(&self, db: &TestDb, written: &Written, patience: Duration) -> Report {
        assert!(
            eventually(patience, || async { db.pending().await == 0 }).await,
            "outbox not drained within {patience:?}"
        );
        let reread = std::cell::Cell::new(0);
        let all_seen = || crate::check::all_seen(written, &self.seen());
        eventually(patience, || async {
            if self.count() < written.committed.len() {
                return false;
            }
            if let Sink::Kafka { fixture, .. } = self {
                if !all_seen() {
                    reread.set(reread.get() + fixture.read_skipped().await);
                }
            }
            all_seen()
        })
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let reread = reread.get();
        if reread > 0 {
            println!(
                "{reread} record(s) the live consumer skipped were read again at their offsets"
            );
        }
        let report = check(written, &self.seen());
        if !report.lost.is_empty() {
            let records = match self {
                Sink::Kafka { fixture, .. } => fixture.records(),
                Sink::Amqp(_) => Vec::new(),
            };
            println!("{}", explain_loss(db, &report.lost, &records).await);
        }
        report
    }

    /// The relay's environment for this broker. `via` replaces the broker's
    /// address (host:port), e.g. with a proxy in front of it.
    pub fn relay_env(&self, via: Option<&str>) -> Vec<(&'static str, String)> {
        match self {
            Sink::Amqp(_) => vec![
                ("OUTBOX_BROKER", "amqp".into()),
                (
                    "OUTBOX_AMQP_URL",
                    match via {
                        Some(addr) => format!("amqp://guest:guest@{addr}/%2f"),
                        None => crate::amqp_url(),
                    },
                ),
            ],
            Sink::Kafka { brokers, .. } => vec![
                ("OUTBOX_BROKER", "kafka".into()),
                ("OUTBOX_KAFKA_BROKERS", via.unwrap_or(brokers).to_owned()),
            ],
        }
    }

    /// Stops the consumer and removes what it created.
    pub async fn cleanup(self) {
        match self {
            Sink::Amqp(f) => f.cleanup().await,
            Sink::Kafka { fixture, .. } => fixture.stop().await,
        }
    }
}

/// Where the first few of `lost` are: still in the outbox, dead-lettered,
/// or confirmed by the broker (a receipt, in retention mode), and for
/// Kafka what the consumer read at that receipt's offset and any gaps in
/// the offsets it read.
pub async fn explain_loss(db: &TestDb, lost: &[uuid::Uuid], records: &[Record]) -> String {
    let mut out = format!("{} committed message(s) not delivered", lost.len());
    for id in lost.iter().take(5) {
        let mut places = Vec::new();
        for table in ["messages", "dead_letters", "published"] {
            let rows = db
                .client
                .query(
                    &format!(
                        "SELECT to_jsonb(t) - 'payload' FROM {}.{table} t WHERE message_id = $1",
                        db.schema.quoted()
                    ),
                    &[id],
                )
                .await
                .map(|rows| {
                    rows.iter()
                        .map(|r| r.get::<_, serde_json::Value>(0))
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default();
            for row in rows {
                let mut place = format!("{table}: {row}");
                let receipt = &row["receipt"];
                if let (Some(p), Some(o)) =
                    (receipt["partition"].as_i64(), receipt["offset"].as_i64())
                {
                    let there: Vec<String> = records
                        .iter()
                        .filter(|r| i64::from(r.partition) == p && r.offset == o)
                        .map(|r| r.headers.get("message-id").cloned().unwrap_or_default())
                        .collect();
                    place.push_str(&format!("; the consumer read at that offset: {there:?}"));
                }
                places.push(place);
            }
        }
        if places.is_empty() {
            places.push("in none of messages, dead_letters, published".into());
        }
        out.push_str(&format!("\n  {id}: {}", places.join(" | ")));
    }
    for (partition, from, until) in crate::kafka::gaps(records) {
        out.push_str(&format!(
            "\n  partition {partition}: offsets {from}..{until} never read"
        ));
    }
    out
}
