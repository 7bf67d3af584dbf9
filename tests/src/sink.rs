//! One broker-neutral face for the suites' independent consumers, so a
//! scenario is written once and run against RabbitMQ and Kafka alike.

use std::time::Duration;

use crate::check::{check, Report, Seen};
use crate::db::TestDb;
use crate::eventually;
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
            Sink::Kafka { fixture, .. } => crate::seen_kafka(&fixture.records()),
        }
    }

    /// Waits up to `patience` for `db`'s outbox to drain and for this
    /// consumer to hold at least what `written` committed, lets late
    /// duplicates land, then checks what arrived against what was written.
    pub async fn settle(&self, db: &TestDb, written: &Written, patience: Duration) -> Report {
        assert!(
            eventually(patience, || async { db.pending().await == 0 }).await,
            "outbox not drained within {patience:?}"
        );
        assert!(
            eventually(patience, || async {
                self.count() >= written.committed.len()
            })
            .await,
            "only {} of {} delivered within {patience:?}",
            self.count(),
            written.committed.len()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        check(written, &self.seen())
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
