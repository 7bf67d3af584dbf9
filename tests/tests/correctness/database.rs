//! Conditions on the database side: late commits and rollbacks, NOTIFY on
//! under load, a session idle in a transaction that `status` must name, and
//! settles the database refuses.

use std::time::{Duration, Instant};

use outbox_tests::check::record;
use outbox_tests::db::TestDb;
use outbox_tests::process::RelayProcess;
use outbox_tests::sink::Sink;
use outbox_tests::workload::{self, Spec};

use super::{env_for, scale, settle, spec, stop, BATCH, RELAY_BIN, TMP};

/// Scenario 4: transactions held open for seconds commit after later ids were
/// published (the commit-order gap); 10% roll back.
async fn late_commits_and_rollbacks(sink: Sink) {
    outbox_tests::init_logging();
    let started = Instant::now();
    let db = TestDb::new().await;
    let relay = RelayProcess::start(RELAY_BIN, &env_for(&db, &sink, None));
    let spec = Spec {
        hold_percent: 3,
        hold: Duration::from_secs(2),
        ..spec(&sink, scale(5_000))
    };
    let written = workload::run(&db.config, &db.outbox(), &spec).await;
    let report = settle(&db, &sink, &written).await;
    record(
        TMP,
        &format!("{}: late commits (held 2s) + 10% rollbacks", sink.broker()),
        &report,
        started.elapsed(),
        Some(0),
    );
    assert!(report.is_clean(), "{report}");
    assert_eq!(report.duplicates, 0, "{report}");
    assert!(!written.rolled_back.is_empty());
    stop(relay).await;
    sink.cleanup().await;
    db.cleanup().await;
}

#[tokio::test]
async fn s04_amqp_late_commits_and_rollbacks() {
    late_commits_and_rollbacks(Sink::amqp().await).await;
}

#[tokio::test]
async fn s04_kafka_late_commits_and_rollbacks() {
    late_commits_and_rollbacks(Sink::kafka(&outbox_tests::kafka_brokers()).await).await;
}

/// Scenario 8: NOTIFY on under load (off is the default every other scenario
/// runs with): notifications beside polling deliver everything once.
async fn notify_on_under_load(sink: Sink) {
    outbox_tests::init_logging();
    let started = Instant::now();
    let db = TestDb::new().await;
    outbox_client::set_notify(&db.client, db.schema.as_str(), true)
        .await
        .expect("notify on");
    let relay = RelayProcess::start(RELAY_BIN, &env_for(&db, &sink, None));
    let written = workload::run(&db.config, &db.outbox(), &spec(&sink, scale(5_000))).await;
    let report = settle(&db, &sink, &written).await;
    record(
        TMP,
        &format!("{}: notify on", sink.broker()),
        &report,
        started.elapsed(),
        Some(0),
    );
    assert!(report.is_clean(), "{report}");
    assert_eq!(report.duplicates, 0);
    stop(relay).await;
    sink.cleanup().await;
    db.cleanup().await;
}

#[tokio::test]
async fn s08_amqp_notify_on_under_load() {
    notify_on_under_load(Sink::amqp().await).await;
}

#[tokio::test]
async fn s08_kafka_notify_on_under_load() {
    notify_on_under_load(Sink::kafka(&outbox_tests::kafka_brokers()).await).await;
}

/// Scenario 11: a session idle in a transaction holds back vacuum for the whole
/// run: nothing is lost, and `status` names the blocker.
async fn idle_in_transaction_blocker_is_named(sink: Sink) {
    outbox_tests::init_logging();
    let started = Instant::now();
    let db = TestDb::new().await;
    let mut blocker = outbox_tests::db::connect(&db.config).await;
    blocker
        .batch_execute("SET application_name = 'forgotten-report'")
        .await
        .expect("name");
    let tx = blocker.transaction().await.expect("begin");
    tx.query_one("SELECT txid_current()", &[])
        .await
        .expect("take an xid");

    let relay = RelayProcess::start(RELAY_BIN, &env_for(&db, &sink, None));
    let written = workload::run(&db.config, &db.outbox(), &spec(&sink, scale(4_000))).await;
    let report = settle(&db, &sink, &written).await;
    // The blocker has been open well past status' 10 s threshold by now, or soon.
    let mut named = false;
    for _ in 0..300 {
        let v = outbox_relay::ops::status(&db.client, &db.schema, true)
            .await
            .expect("status");
        named = v.blockers.iter().any(|b| {
            matches!(
                b,
                outbox_relay::ops::Blocker::LongTransaction { application: Some(a), .. }
                    if a == "forgotten-report"
            )
        });
        if named {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tx.rollback().await.expect("rollback");
    record(
        TMP,
        &format!("{}: idle-in-transaction session", sink.broker()),
        &report,
        started.elapsed(),
        Some(0),
    );
    assert!(report.is_clean(), "{report}");
    assert!(named, "status must name the long transaction");
    stop(relay).await;
    sink.cleanup().await;
    db.cleanup().await;
}

#[tokio::test]
async fn s11_amqp_idle_in_transaction_blocker_is_named() {
    idle_in_transaction_blocker_is_named(Sink::amqp().await).await;
}

#[tokio::test]
async fn s11_kafka_idle_in_transaction_blocker_is_named() {
    idle_in_transaction_blocker_is_named(Sink::kafka(&outbox_tests::kafka_brokers()).await).await;
}

/// A settle Postgres refuses commits nothing. The relay sends a batch's
/// settle statements and its COMMIT in one round trip; when one of them
/// fails, COMMIT only rolls back, and the relay must take the batch as not
/// settled: every row stays, goes to the broker again, and none counts as
/// published, until the database lets the settle through.
async fn refused_settle_commits_nothing(sink: Sink) {
    outbox_tests::init_logging();
    let started = Instant::now();
    let db = TestDb::new().await;
    let schema = db.schema.quoted();
    db.client
        .batch_execute(&format!(
            "CREATE FUNCTION {schema}.refuse_settle() RETURNS trigger LANGUAGE plpgsql AS \
               $$ BEGIN RAISE EXCEPTION 'settle refused by the test'; END $$; \
             CREATE TRIGGER refuse_settle BEFORE DELETE ON {} \
               FOR EACH ROW EXECUTE FUNCTION {schema}.refuse_settle()",
            db.table()
        ))
        .await
        .expect("trigger");
    let port = outbox_tests::free_port();
    let mut env = env_for(&db, &sink, None);
    env.push(("OUTBOX_HTTP_ADDR", format!("127.0.0.1:{port}")));
    let relay = RelayProcess::start(RELAY_BIN, &env);
    let written = workload::run(&db.config, &db.outbox(), &spec(&sink, 1_000)).await;
    let committed = written.committed.len();
    // The oldest rows go to the broker again and again: each settle was
    // refused, each batch claimed anew. (Claims take the oldest rows, so the
    // later ones wait until a settle goes through.)
    assert!(
        outbox_tests::eventually(super::PATIENCE, || async {
            let mut times: std::collections::HashMap<String, usize> = Default::default();
            for d in sink.seen() {
                *times.entry(d.message_id).or_default() += 1;
            }
            times.values().filter(|n| **n >= 3).count() >= BATCH
        })
        .await,
        "the batches whose settle was refused were not published again"
    );
    assert_eq!(
        db.pending().await,
        committed as i64,
        "a row left the outbox though its settle was refused"
    );
    let metrics = outbox_tests::http::scrape(port).await;
    assert!(
        metrics.contains("outbox_messages_total") || metrics.contains("outbox_build_info"),
        "no metrics page on port {port}"
    );
    assert_eq!(
        outbox_tests::http::published(&metrics),
        0.0,
        "messages counted as published though every settle was refused"
    );

    db.client
        .batch_execute(&format!("DROP TRIGGER refuse_settle ON {}", db.table()))
        .await
        .expect("drop trigger");
    let report = settle(&db, &sink, &written).await;
    record(
        TMP,
        &format!("{}: settles refused, then let through", sink.broker()),
        &report,
        started.elapsed(),
        None,
    );
    assert!(report.is_clean(), "{report}");
    assert!(
        outbox_tests::eventually(super::PATIENCE, || async {
            outbox_tests::http::published(&outbox_tests::http::scrape(port).await)
                >= committed as f64
        })
        .await,
        "the settles let through were not counted as published"
    );
    stop(relay).await;
    sink.cleanup().await;
    db.cleanup().await;
}

#[tokio::test]
async fn s13_amqp_refused_settle_commits_nothing() {
    refused_settle_commits_nothing(Sink::amqp().await).await;
}
