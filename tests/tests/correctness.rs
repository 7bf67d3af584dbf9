//! The fault-injection correctness suite: each scenario runs writers and a relay
//! under one fault and checks, with an independent consumer, that nothing was
//! lost, nothing rolled back arrived, duplicates stayed within the scenario's
//! stated bound, ids were stable and per-key order held.
//!
//! Each scenario appends a row to the summary table that `tests/run.sh` prints.
//! `OUTBOX_CORRECTNESS_PROFILE=long` scales the workloads up for soak runs
//! (see README).
//!
//! Broker and database restarts live in their own test binaries
//! (`amqp_outage.rs`, `pg_restart.rs`): they would disturb scenarios running
//! beside them. Here faults touch only the scenario's own relay or connection.

use std::time::{Duration, Instant};

use outbox_tests::amqp::Fixture;
use outbox_tests::check::{check, record, Report};
use outbox_tests::db::TestDb;
use outbox_tests::process::RelayProcess;
use outbox_tests::proxy::{Mode, Proxy};
use outbox_tests::workload::{self, Spec, Written};
use outbox_tests::{eventually, seen_amqp};
use rand::Rng;

const RELAY_BIN: &str = env!("CARGO_BIN_EXE_outbox-relay-under-test");
const TMP: &str = env!("CARGO_TARGET_TMPDIR");
const PATIENCE: Duration = Duration::from_secs(300);
const BATCH: usize = 100;
const PIPELINE: usize = 2;

/// Messages per scenario: small for CI, large for soak runs.
fn scale(ci: usize) -> usize {
    match std::env::var("OUTBOX_CORRECTNESS_PROFILE").as_deref() {
        Ok("long") => 1_000_000,
        _ => ci,
    }
}

fn env_for(db: &TestDb, amqp_url: &str) -> Vec<(&'static str, String)> {
    vec![
        ("OUTBOX_SCHEMA", db.schema.to_string()),
        ("OUTBOX_AMQP_URL", amqp_url.to_owned()),
        ("OUTBOX_BATCH_SIZE", BATCH.to_string()),
        ("OUTBOX_PIPELINE", PIPELINE.to_string()),
        ("OUTBOX_POLL_INTERVAL", "200ms".into()),
        ("OUTBOX_RECONNECT_MAX", "1s".into()),
        ("OUTBOX_CONFIRM_TIMEOUT", "3s".into()),
        ("OUTBOX_HOLD_LIMIT", "10s".into()),
    ]
}

fn spec(rabbit: &Fixture, messages: usize) -> Spec {
    Spec {
        max_commit_delay: Duration::from_millis(10),
        ..Spec::new(&rabbit.exchange, 6, 60, messages)
    }
}

/// Waits for the outbox to drain and the consumer to catch up, then checks.
async fn settle(db: &TestDb, rabbit: &Fixture, written: &Written) -> Report {
    assert!(
        eventually(PATIENCE, || async { db.pending().await == 0 }).await,
        "outbox not drained"
    );
    assert!(
        eventually(PATIENCE, || async {
            rabbit.count() >= written.committed.len()
        })
        .await,
        "only {} of {} delivered",
        rabbit.count(),
        written.committed.len()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    check(written, &seen_amqp(&rabbit.deliveries()))
}

fn spawn_writers(db: &TestDb, spec: Spec) -> tokio::task::JoinHandle<Written> {
    let config = db.config.clone();
    let outbox = db.outbox();
    tokio::spawn(async move { workload::run(&config, &outbox, &spec).await })
}

/// Scenario 2: kill -9 at random 200–2000 ms intervals, restarted each time.
#[tokio::test]
async fn s02_kill_9_at_random_intervals() {
    outbox_tests::init_logging();
    let started = Instant::now();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let env = env_for(&db, &outbox_tests::amqp_url());
    let writers = spawn_writers(&db, spec(&rabbit, scale(8_000)));
    let mut relay = RelayProcess::start(RELAY_BIN, &env);
    let mut kills = 0;
    while !writers.is_finished() || (db.pending().await > 0 && kills < 60) {
        let ms = rand::rng().random_range(200..2000);
        tokio::time::sleep(Duration::from_millis(ms)).await;
        relay.kill9().await;
        kills += 1;
        relay = RelayProcess::start(RELAY_BIN, &env);
    }
    let written = writers.await.expect("writers");
    let report = settle(&db, &rabbit, &written).await;
    let bound = kills * BATCH * PIPELINE;
    record(
        TMP,
        &format!("amqp: kill -9 x{kills} at random intervals"),
        &report,
        started.elapsed(),
        Some(bound),
    );
    assert!(report.is_clean(), "{report}");
    assert!(report.duplicates <= bound, "{report}");
    relay.signal("TERM").await;
    assert_eq!(relay.wait().await, Some(0));
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// Scenario 3: the relay dies after the broker confirmed a batch and before the
/// rows were deleted. That batch is delivered twice; nothing is lost.
#[tokio::test]
async fn s03_crash_between_broker_ack_and_delete() {
    outbox_tests::init_logging();
    let started = Instant::now();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let env = env_for(&db, &outbox_tests::amqp_url());
    let written = workload::run(&db.config, &db.outbox(), &spec(&rabbit, scale(3_000))).await;

    let mut crashing = env.clone();
    crashing.push(("OUTBOX_TEST_FAILPOINT", "crash-after-ack:3".into()));
    // One worker, so "the third batch" is one well-defined batch.
    crashing.push(("OUTBOX_PIPELINE", "1".into()));
    let mut relay = RelayProcess::start(RELAY_BIN, &crashing);
    let code = tokio::time::timeout(PATIENCE, relay.wait())
        .await
        .expect("failpoint reached");
    assert_ne!(code, Some(0), "the failpoint aborts the process");

    let mut relay = RelayProcess::start(RELAY_BIN, &env);
    let report = settle(&db, &rabbit, &written).await;
    record(
        TMP,
        "amqp: crash between broker ack and delete",
        &report,
        started.elapsed(),
        Some(BATCH),
    );
    assert!(report.is_clean(), "{report}");
    assert!(
        report.duplicates >= 1,
        "the confirmed-but-undeleted batch must come again: {report}"
    );
    assert!(
        report.duplicates <= BATCH,
        "only that batch may repeat: {report}"
    );
    relay.signal("TERM").await;
    assert_eq!(relay.wait().await, Some(0));
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// Scenario 4: transactions held open for seconds commit after later ids were
/// published (the commit-order gap); 10% roll back.
#[tokio::test]
async fn s04_late_commits_and_rollbacks() {
    outbox_tests::init_logging();
    let started = Instant::now();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let env = env_for(&db, &outbox_tests::amqp_url());
    let mut relay = RelayProcess::start(RELAY_BIN, &env);
    let spec = Spec {
        hold_percent: 3,
        hold: Duration::from_secs(2),
        ..spec(&rabbit, scale(5_000))
    };
    let written = workload::run(&db.config, &db.outbox(), &spec).await;
    let report = settle(&db, &rabbit, &written).await;
    record(
        TMP,
        "amqp: late commits (held 2s) + 10% rollbacks",
        &report,
        started.elapsed(),
        Some(0),
    );
    assert!(report.is_clean(), "{report}");
    assert_eq!(report.duplicates, 0, "{report}");
    assert!(!written.rolled_back.is_empty());
    relay.signal("TERM").await;
    assert_eq!(relay.wait().await, Some(0));
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// Scenario 6: a proxy between relay and broker black-holes traffic (accepts,
/// never answers) for 10 s, then resets every connection.
#[tokio::test]
async fn s06_black_holed_then_reset_broker_connection() {
    outbox_tests::init_logging();
    let started = Instant::now();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let proxy = Proxy::start("127.0.0.1:5672").await;
    let url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port);
    let mut relay = RelayProcess::start(RELAY_BIN, &env_for(&db, &url));
    let writers = spawn_writers(&db, spec(&rabbit, scale(5_000)));
    assert!(
        eventually(PATIENCE, || async { rabbit.count() > 300 }).await,
        "no flow before the fault"
    );
    proxy.set(Mode::BlackHole);
    tokio::time::sleep(Duration::from_secs(10)).await;
    let during = db.pending().await;
    proxy.set(Mode::Refuse); // resets every open connection
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.set(Mode::Pass);
    let written = writers.await.expect("writers");
    let report = settle(&db, &rabbit, &written).await;
    // Only batches in flight when the link went silent can repeat.
    let bound = 2 * BATCH * PIPELINE;
    record(
        TMP,
        "amqp: black-holed 10s, then reset",
        &report,
        started.elapsed(),
        Some(bound),
    );
    assert!(report.is_clean(), "{report}");
    assert!(report.duplicates <= bound, "{report}");
    assert!(during > 0, "the black hole should have built a backlog");
    relay.signal("TERM").await;
    assert_eq!(relay.wait().await, Some(0));
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// Scenario 8: NOTIFY off under load: polling alone delivers everything.
#[tokio::test]
async fn s08_notify_off_under_load() {
    outbox_tests::init_logging();
    let started = Instant::now();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    outbox_client::set_notify(&db.client, db.schema.as_str(), false)
        .await
        .expect("notify off");
    let mut relay = RelayProcess::start(RELAY_BIN, &env_for(&db, &outbox_tests::amqp_url()));
    let written = workload::run(&db.config, &db.outbox(), &spec(&rabbit, scale(5_000))).await;
    let report = settle(&db, &rabbit, &written).await;
    record(TMP, "amqp: notify off", &report, started.elapsed(), Some(0));
    assert!(report.is_clean(), "{report}");
    assert_eq!(report.duplicates, 0);
    relay.signal("TERM").await;
    assert_eq!(relay.wait().await, Some(0));
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// Scenario 11: a session idle in a transaction holds back vacuum for the whole
/// run: nothing is lost, and `status` names the blocker.
#[tokio::test]
async fn s11_idle_in_transaction_blocker_is_named() {
    outbox_tests::init_logging();
    let started = Instant::now();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let mut blocker = outbox_tests::db::connect(&db.config).await;
    blocker
        .batch_execute("SET application_name = 'forgotten-report'")
        .await
        .expect("name");
    let tx = blocker.transaction().await.expect("begin");
    tx.query_one("SELECT txid_current()", &[])
        .await
        .expect("take an xid");

    let mut relay = RelayProcess::start(RELAY_BIN, &env_for(&db, &outbox_tests::amqp_url()));
    let written = workload::run(&db.config, &db.outbox(), &spec(&rabbit, scale(4_000))).await;
    let report = settle(&db, &rabbit, &written).await;
    // The blocker has been open well past status' 10 s threshold by now, or soon.
    let mut named = false;
    for _ in 0..300 {
        let v = outbox_relay::ops::status(&db.client, &db.schema)
            .await
            .expect("status");
        named = v["blockers"].as_array().is_some_and(|bs| {
            bs.iter()
                .any(|b| b["kind"] == "long_transaction" && b["application"] == "forgotten-report")
        });
        if named {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tx.rollback().await.expect("rollback");
    record(
        TMP,
        "amqp: idle-in-transaction session",
        &report,
        started.elapsed(),
        Some(0),
    );
    assert!(report.is_clean(), "{report}");
    assert!(named, "status must name the long transaction");
    relay.signal("TERM").await;
    assert_eq!(relay.wait().await, Some(0));
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// Testing the tester: a relay that deletes rows before the broker confirms
/// loses messages when the broker is unreachable, and the checker must say so.
#[tokio::test]
async fn mutant_ack_before_confirm_is_caught() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let proxy = Proxy::start("127.0.0.1:5672").await;
    let url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port);
    let mut env = env_for(&db, &url);
    env.push(("OUTBOX_TEST_MUTANT", "ack-before-confirm".into()));
    let mut relay = RelayProcess::start(RELAY_BIN, &env);
    let writers = spawn_writers(&db, spec(&rabbit, 3_000));
    assert!(eventually(PATIENCE, || async { rabbit.count() > 100 }).await);
    proxy.set(Mode::Refuse);
    tokio::time::sleep(Duration::from_secs(3)).await;
    proxy.set(Mode::Pass);
    let written = writers.await.expect("writers");
    assert!(eventually(PATIENCE, || async { db.pending().await == 0 }).await);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let report = check(&written, &seen_amqp(&rabbit.deliveries()));
    println!("mutant ack-before-confirm: {report}");
    assert!(
        !report.lost.is_empty(),
        "the checker missed the losses of ack-before-confirm: {report}"
    );
    relay.signal("TERM").await;
    let _ = relay.wait().await;
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// Testing the tester: a relay that polls with an `id > last_seen` watermark
/// never publishes rows that commit late, and the checker must say so.
#[tokio::test]
async fn mutant_watermark_is_caught() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let mut env = env_for(&db, &outbox_tests::amqp_url());
    env.push(("OUTBOX_TEST_MUTANT", "watermark".into()));
    let mut relay = RelayProcess::start(RELAY_BIN, &env);
    let spec = Spec {
        hold_percent: 5,
        hold: Duration::from_secs(1),
        ..spec(&rabbit, 2_000)
    };
    let written = workload::run(&db.config, &db.outbox(), &spec).await;
    // Let every row the mutant will ever publish arrive.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let report = check(&written, &seen_amqp(&rabbit.deliveries()));
    println!("mutant watermark: {report}");
    assert!(
        !report.lost.is_empty(),
        "the checker missed the losses of a watermark: {report}"
    );
    relay.signal("TERM").await;
    let _ = relay.wait().await;
    rabbit.cleanup().await;
    db.cleanup().await;
}
