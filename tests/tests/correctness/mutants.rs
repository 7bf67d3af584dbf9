//! Testing the tester: relays with a known bug lose messages, and the checker
//! must say so.

use std::time::Duration;

use outbox_tests::check::check;
use outbox_tests::db::TestDb;
use outbox_tests::eventually;
use outbox_tests::process::RelayProcess;
use outbox_tests::proxy::{Mode, Proxy};
use outbox_tests::sink::Sink;
use outbox_tests::workload::{self, Spec};

use super::{env_for, spec, PATIENCE, RELAY_BIN};

/// Waits until the consumer has received nothing for 2 s (for at most
/// `PATIENCE`): a message missing then is lost, not late. A fixed sleep let
/// a consumer running behind pass for a mutant's losses.
async fn until_quiet(sink: &Sink) {
    let deadline = std::time::Instant::now() + PATIENCE;
    let mut before = sink.count();
    while std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let now = sink.count();
        if now == before {
            return;
        }
        before = now;
    }
}

/// Testing the tester: a relay that deletes rows before the broker confirms
/// loses messages when the broker is unreachable, and the checker must say so.
#[tokio::test]
async fn mutant_ack_before_confirm_is_caught() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let sink = Sink::amqp().await;
    let proxy = Proxy::start("127.0.0.1:5672").await;
    let mut env = env_for(&db, &sink, Some(&format!("127.0.0.1:{}", proxy.port)));
    env.push(("OUTBOX_TEST_MUTANT", "ack-before-confirm".into()));
    let mut relay = RelayProcess::start(RELAY_BIN, &env);
    let writers = workload::spawn(&db, spec(&sink, 3_000));
    assert!(eventually(PATIENCE, || async { sink.count() > 100 }).await);
    proxy.set(Mode::Refuse);
    tokio::time::sleep(Duration::from_secs(3)).await;
    proxy.set(Mode::Pass);
    let written = writers.await.expect("writers");
    assert!(eventually(PATIENCE, || async { db.pending().await == 0 }).await);
    until_quiet(&sink).await;
    let report = check(&written, &sink.seen());
    println!("mutant ack-before-confirm: {report}");
    assert!(
        !report.lost.is_empty(),
        "the checker missed the losses of ack-before-confirm: {report}"
    );
    relay.signal("TERM").await;
    let _ = relay.wait().await;
    sink.cleanup().await;
    db.cleanup().await;
}

/// Testing the tester: a relay that polls with an `id > last_seen` watermark
/// never publishes rows that commit late, and the checker must say so.
#[tokio::test]
async fn mutant_watermark_is_caught() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let sink = Sink::amqp().await;
    let mut env = env_for(&db, &sink, None);
    env.push(("OUTBOX_TEST_MUTANT", "watermark".into()));
    let mut relay = RelayProcess::start(RELAY_BIN, &env);
    let spec = Spec {
        hold_percent: 5,
        hold: Duration::from_secs(1),
        ..spec(&sink, 2_000)
    };
    let written = workload::run(&db.config, &db.outbox(), &spec).await;
    // Let every row the mutant will ever publish arrive.
    tokio::time::sleep(Duration::from_secs(1)).await;
    until_quiet(&sink).await;
    let report = check(&written, &sink.seen());
    println!("mutant watermark: {report}");
    assert!(
        !report.lost.is_empty(),
        "the checker missed the losses of a watermark: {report}"
    );
    relay.signal("TERM").await;
    let _ = relay.wait().await;
    sink.cleanup().await;
    db.cleanup().await;
}
