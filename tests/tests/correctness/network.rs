//! The link between relay and broker black-holed, then reset.

use std::time::{Duration, Instant};

use outbox_tests::db::TestDb;
use outbox_tests::eventually;
use outbox_tests::process::{tansu_behind_proxy, RelayProcess};
use outbox_tests::proxy::{Mode, Proxy};
use outbox_tests::sink::Sink;
use outbox_tests::workload;

use super::{env_for, scale, settle_within, spec, stop, BATCH, PATIENCE, PIPELINE, RELAY_BIN};

/// Scenario 6: a proxy between relay and broker black-holes traffic (accepts,
/// never answers) for 10 s, then resets every connection.
async fn black_holed_then_reset(db: TestDb, sink: Sink, proxy: &Proxy) {
    outbox_tests::init_logging();
    let started = Instant::now();
    let via = format!("127.0.0.1:{}", proxy.port);
    let relay = RelayProcess::start(RELAY_BIN, &env_for(&db, &sink, Some(&via)));
    let writers = workload::spawn(&db, spec(&sink, scale(5_000)));
    assert!(
        eventually(PATIENCE, || async { sink.count() > 300 }).await,
        "no flow before the fault"
    );
    proxy.set(Mode::BlackHole);
    tokio::time::sleep(Duration::from_secs(10)).await;
    let during = db.pending().await;
    proxy.set(Mode::Refuse); // resets every open connection
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.set(Mode::Pass);
    let written = writers.await.expect("writers");
    // Only batches in flight when the link went silent can repeat.
    let bound = 2 * BATCH * (PIPELINE + 1);
    settle_within(
        &db,
        &sink,
        &written,
        &format!("{}: black-holed 10s, then reset", sink.broker()),
        started,
        bound,
    )
    .await;
    assert!(during > 0, "the black hole should have built a backlog");
    stop(relay).await;
    sink.cleanup().await;
    db.cleanup().await;
}

#[tokio::test]
async fn s06_amqp_black_holed_then_reset_broker_connection() {
    let proxy = Proxy::start("127.0.0.1:5672").await;
    black_holed_then_reset(TestDb::new().await, Sink::amqp().await, &proxy).await;
}

#[tokio::test]
async fn s06_kafka_black_holed_then_reset_broker_connection() {
    // A private broker that advertises the proxy, so every connection (the
    // relay's and the consumer's) crosses it.
    let (tansu, proxy, brokers) = tansu_behind_proxy().await;
    black_holed_then_reset(TestDb::new().await, Sink::kafka(&brokers).await, &proxy).await;
    tansu.stop().await;
}
