//! Postgres behind a load balancer whose backend vanished: HAProxy in front
//! of a Patroni cluster, say, when the primary's host dies. The balancer
//! keeps the relay's connections open and answers nothing on them, for as
//! long as its own timeouts allow (half an hour in common setups). Its
//! kernel acknowledges every byte and every keepalive probe, so neither
//! `tcp_user_timeout` nor keepalives notice. New connections reach the new
//! primary. The relay must give up on a session that stops answering and
//! open another, or it stalls with every message waiting.

use std::time::Duration;

use outbox_tests::db::TestDb;
use outbox_tests::proxy::{Mode, Proxy};
use outbox_tests::sink::Sink;
use outbox_tests::workload::{self, Spec};
use outbox_tests::{eventually, fast_settings, InProcessRelay};

use super::PATIENCE;

/// A stream flows through the relay while writers keep committing. Then
/// every connection the relay has open to Postgres goes silent for good,
/// and so does every connection it opens in the next few seconds; after
/// that, new connections get through. Nothing may be lost or reordered,
/// and duplicates stay within the batches that were in flight.
///
/// Before the fix, the relay stalled for good: its workers, its durability
/// barrier and its reconnects waited on answers that never came, and the
/// outbox was never drained.
#[tokio::test]
async fn sessions_a_balancer_strands_are_given_up_and_nothing_is_lost() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let sink = Sink::amqp().await;
    let proxy = Proxy::start(&db.address()).await;
    let url = format!(
        "postgres://{}@127.0.0.1:{}/{}",
        db.config.get_user().unwrap_or("postgres"),
        proxy.port,
        db.config.get_dbname().unwrap_or("postgres"),
    );
    let config: tokio_postgres::Config = url.parse().expect("relay's database url");
    let settings = outbox_relay::Settings {
        hold_limit: Duration::from_secs(8),
        lease: Duration::from_secs(2),
        ..fast_settings()
    };
    let (batch, workers) = (settings.batch_size as usize, settings.pipeline + 1);
    let relay = InProcessRelay::amqp_on(config, &db, settings);

    let spec = Spec {
        max_commit_delay: Duration::from_millis(20),
        ..Spec::new(sink.destination(), 4, 40, 4_000)
    };
    let written = workload::spawn(&db, spec);
    assert!(
        eventually(PATIENCE, || async { sink.count() >= 300 }).await,
        "the relay never got going through the proxy"
    );
    proxy.set(Mode::Strand);
    let stranded_at = sink.count();
    tokio::time::sleep(Duration::from_secs(3)).await;
    proxy.set(Mode::Pass);
    let written = written.await.expect("writers");
    let report = sink.settle(&db, &written, PATIENCE).await;
    println!("stranded after {stranded_at} deliveries, new connections stranded for 3 s: {report}");
    assert!(report.is_clean(), "{report}");
    let bound = batch * workers;
    assert!(
        report.duplicates <= bound,
        "{} duplicates, more than the {bound} rows the relay's batches can hold: {report}",
        report.duplicates
    );

    relay.stop().await;
    drop(proxy);
    sink.cleanup().await;
    db.cleanup().await;
}
