//! The link between relay and broker black-holed, then reset.

use std::time::{Duration, Instant};

use outbox_tests::db::TestDb;
use outbox_tests::eventually;
use outbox_tests::process::{tansu_behind_proxy, RelayProcess};
use outbox_tests::proxy::{Mode, Proxy};
use outbox_tests::sink::Sink;
use outbox_tests::workload::{self, Spec};

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

/// What the slow link of scenario 7 carries from relay to broker, in bytes
/// per second.
const SLOW_LINK: u64 = 100_000;

/// Scenario 7: the link from relay to broker slows to a crawl (a saturated
/// link, or RabbitMQ reading slowly under flow control) and stays slow. A
/// batch of 100 messages of 4 KB takes about 4 s to cross it, longer than
/// the confirm timeout (3 s), and two batches in flight longer than half the
/// hold limit (5 s). The relay must keep publishing at the link's pace
/// while it is slow, and repeat no more than one cut-short set of batches.
async fn slow_link(db: TestDb, sink: Sink, proxy: &Proxy) {
    outbox_tests::init_logging();
    let started = Instant::now();
    let via = format!("127.0.0.1:{}", proxy.port);
    let relay = RelayProcess::start(RELAY_BIN, &env_for(&db, &sink, Some(&via)));
    proxy.throttle(SLOW_LINK);
    let spec = Spec {
        pad: 4_000,
        ..spec(&sink, 600)
    };
    let written = workload::spawn(&db, spec).await.expect("writers");
    // About 2.5 MB: 25 s at the link's pace.
    let drained = eventually(PATIENCE, || async { db.pending().await == 0 }).await;
    let left = db.pending().await;
    proxy.throttle(0);
    assert!(
        drained,
        "{left} of {} rows still waiting after {PATIENCE:?} on a link of {SLOW_LINK} bytes/s",
        written.committed.len()
    );
    let bound = BATCH * (PIPELINE + 1);
    settle_within(
        &db,
        &sink,
        &written,
        &format!("{}: link slowed to {SLOW_LINK} bytes/s", sink.broker()),
        started,
        bound,
    )
    .await;
    stop(relay).await;
    sink.cleanup().await;
    db.cleanup().await;
}

#[tokio::test]
async fn s07_amqp_slow_link_to_the_broker() {
    let proxy = Proxy::start("127.0.0.1:5672").await;
    slow_link(TestDb::new().await, Sink::amqp().await, &proxy).await;
}

#[tokio::test]
async fn s07_kafka_slow_link_to_the_broker() {
    let (tansu, proxy, brokers) = tansu_behind_proxy().await;
    slow_link(TestDb::new().await, Sink::kafka(&brokers).await, &proxy).await;
    tansu.stop().await;
}
