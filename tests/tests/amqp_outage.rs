//! RabbitMQ stopped for 10 s mid-run. In a test binary of its own: stopping the
//! broker would disturb every other test running beside it.

use std::time::Duration;

use outbox_tests::amqp::Fixture;
use outbox_tests::check::check;
use outbox_tests::db::TestDb;
use outbox_tests::workload::{self, Spec};
use outbox_tests::{eventually, fast_settings, seen_amqp, InProcessRelay};
use std::sync::atomic::Ordering;

async fn rabbitmqctl(args: &[&str]) {
    let status = tokio::process::Command::new("rabbitmqctl")
        .args(args)
        .stdout(std::process::Stdio::null())
        .status()
        .await
        .expect("run rabbitmqctl");
    assert!(status.success(), "rabbitmqctl {args:?} failed");
}

#[tokio::test]
async fn broker_stopped_for_10s_then_everything_is_delivered() {
    outbox_tests::init_logging();
    let started = std::time::Instant::now();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let relay = InProcessRelay::amqp(&db, fast_settings());

    // Writers keep committing through the outage.
    let spec = Spec {
        max_commit_delay: Duration::from_millis(20),
        ..Spec::new(&rabbit.exchange, 4, 40, 6_000)
    };
    let writers = {
        let config = db.config.clone();
        let outbox = db.outbox();
        tokio::spawn(async move { workload::run(&config, &outbox, &spec).await })
    };
    assert!(eventually(Duration::from_secs(60), || async { rabbit.count() > 200 }).await);

    rabbitmqctl(&["stop_app"]).await;
    let failures_before = relay.stats.batch_failures.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(10)).await;
    let backlog_during_outage = db.pending().await;
    rabbitmqctl(&["start_app"]).await;
    rabbitmqctl(&["await_startup"]).await;

    let written = writers.await.expect("writers");
    assert!(
        eventually(Duration::from_secs(120), || async {
            db.pending().await == 0
        })
        .await,
        "outbox not drained after the broker came back"
    );
    assert!(
        eventually(Duration::from_secs(120), || async {
            rabbit.count() >= written.committed.len()
        })
        .await,
        "only {} of {} delivered",
        rabbit.count(),
        written.committed.len()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let report = check(&written, &seen_amqp(&rabbit.deliveries()));
    println!(
        "broker outage: {report}; backlog during outage {backlog_during_outage}; failed batches {}",
        relay.stats.batch_failures.load(Ordering::Relaxed) - failures_before
    );
    outbox_tests::check::record(
        env!("CARGO_TARGET_TMPDIR"),
        "amqp: rabbitmq stopped 10s",
        &report,
        started.elapsed(),
        None,
    );
    assert!(report.is_clean(), "{report}");
    assert!(
        backlog_during_outage > 0,
        "the outage should have built a backlog in Postgres"
    );
    assert!(
        relay.stats.batch_failures.load(Ordering::Relaxed) > failures_before,
        "the relay should have seen the broker down"
    );
    // The relay survived the outage: it still stops cleanly on request.
    relay.stop().await;
    rabbit.cleanup().await;
    db.cleanup().await;
}
