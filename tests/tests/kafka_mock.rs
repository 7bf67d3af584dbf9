//! Faults a live broker cannot easily produce, injected with librdkafka's mock
//! cluster: produce-request errors, a broker going down and up, and round trips
//! slower than the message timeout. Nothing may be lost or reordered per key.

use std::time::Duration;

use outbox_tests::check::check;
use outbox_tests::db::TestDb;
use outbox_tests::kafka::Fixture;
use outbox_tests::workload::{self, Spec};
use outbox_tests::{eventually, fast_settings, seen_kafka, InProcessRelay};
use rdkafka::mocking::MockCluster;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

const TMP: &str = env!("CARGO_TARGET_TMPDIR");
const PATIENCE: Duration = Duration::from_secs(120);

/// Runs a 2,000-message workload through a relay producing to `mock`, calling
/// `fault` once the relay is moving, and checks the outcome.
async fn run_with_fault<F>(name: &str, props: &[(&str, &str)], fault: F)
where
    F: AsyncFnOnce(&MockCluster<'static, rdkafka::producer::DefaultProducerContext>),
{
    let started = std::time::Instant::now();
    outbox_tests::init_logging();
    let mock = MockCluster::new(3).expect("mock cluster");
    let brokers = mock.bootstrap_servers();
    let topic = outbox_tests::unique("mock");
    mock.create_topic(&topic, 4, 3).expect("topic");
    let consumer = Fixture::consume(&brokers, &topic, 4);

    let db = TestDb::new().await;
    let relay = InProcessRelay::kafka(&db, &brokers, props, fast_settings());
    let spec = Spec::new(&topic, 4, 20, 2_000);
    let writers = {
        let config = db.config.clone();
        let outbox = db.outbox();
        tokio::spawn(async move { workload::run(&config, &outbox, &spec).await })
    };
    assert!(
        eventually(PATIENCE, || async { consumer.count() > 100 }).await,
        "{name}: nothing flows"
    );
    fault(&mock).await;
    let written = writers.await.expect("writers");
    assert!(
        eventually(PATIENCE, || async { db.pending().await == 0 }).await,
        "{name}: not drained"
    );
    assert!(
        eventually(PATIENCE, || async {
            consumer.count() >= written.committed.len()
        })
        .await,
        "{name}: only {} of {} consumed",
        consumer.count(),
        written.committed.len()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let report = check(&written, &seen_kafka(&consumer.records()));
    outbox_tests::check::record(
        TMP,
        &format!("kafka mock: {name}"),
        &report,
        started.elapsed(),
        None,
    );
    assert!(report.is_clean(), "{name}: {report}");
    relay.stop().await;
    consumer.stop().await;
    db.cleanup().await;
}

async fn produce_errors(name: &str, err: RDKafkaRespErr) {
    run_with_fault(name, &[], async |mock| {
        // Every broker fails the next produce requests with `err`; librdkafka
        // retries them (or the relay retries the batch) until they go through.
        mock.request_errors(RDKafkaApiKey::Produce, &[err; 8]);
        tokio::time::sleep(Duration::from_secs(2)).await;
    })
    .await;
}

#[tokio::test]
async fn not_enough_replicas() {
    produce_errors(
        "NOT_ENOUGH_REPLICAS",
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
    )
    .await;
}

#[tokio::test]
async fn request_timed_out() {
    produce_errors(
        "REQUEST_TIMED_OUT",
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT,
    )
    .await;
}

#[tokio::test]
async fn not_leader_for_partition() {
    produce_errors(
        "NOT_LEADER_FOR_PARTITION",
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION,
    )
    .await;
}

#[tokio::test]
async fn transport_failures() {
    produce_errors("_TRANSPORT", RDKafkaRespErr::RD_KAFKA_RESP_ERR__TRANSPORT).await;
}

#[tokio::test]
async fn brokers_down_then_up() {
    run_with_fault("brokers down", &[], async |mock| {
        for b in 1..=3 {
            mock.broker_down(b).expect("down");
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
        for b in 1..=3 {
            mock.broker_up(b).expect("up");
        }
    })
    .await;
}

#[tokio::test]
async fn round_trips_slower_than_the_message_timeout() {
    // Records time out while "possibly persisted"; the relay must retry them,
    // accepting duplicates, never dropping one.
    run_with_fault(
        "slow round trips",
        &[("message.timeout.ms", "1500")],
        async |mock| {
            for b in 1..=3 {
                mock.broker_round_trip_time(b, Duration::from_secs(3))
                    .expect("rtt");
            }
            tokio::time::sleep(Duration::from_secs(6)).await;
            for b in 1..=3 {
                mock.broker_round_trip_time(b, Duration::ZERO).expect("rtt");
            }
        },
    )
    .await;
}
