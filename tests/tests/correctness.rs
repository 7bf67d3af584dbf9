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

use outbox_tests::check::{check, record, Report};
use outbox_tests::db::TestDb;
use outbox_tests::eventually;
use outbox_tests::process::{tansu_behind_proxy, RelayProcess};
use outbox_tests::proxy::{Mode, Proxy};
use outbox_tests::sink::Sink;
use outbox_tests::workload::{self, Spec, Written};
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

/// The relay's environment for `db` and `sink`; `via` is a proxy's address in
/// front of the broker, if any.
fn env_for(db: &TestDb, sink: &Sink, via: Option<&str>) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("OUTBOX_SCHEMA", db.schema.to_string()),
        ("OUTBOX_BATCH_SIZE", BATCH.to_string()),
        ("OUTBOX_PIPELINE", PIPELINE.to_string()),
        ("OUTBOX_POLL_INTERVAL", "200ms".into()),
        ("OUTBOX_RECONNECT_MAX", "1s".into()),
        ("OUTBOX_CONFIRM_TIMEOUT", "3s".into()),
        ("OUTBOX_HOLD_LIMIT", "10s".into()),
    ];
    env.extend(sink.relay_env(via));
    env
}

fn spec(sink: &Sink, messages: usize) -> Spec {
    Spec {
        max_commit_delay: Duration::from_millis(10),
        ..Spec::new(sink.destination(), 6, 60, messages)
    }
}

/// Waits for the outbox to drain and the consumer to catch up, then checks.
async fn settle(db: &TestDb, sink: &Sink, written: &Written) -> Report {
    assert!(
        eventually(PATIENCE, || async { db.pending().await == 0 }).await,
        "outbox not drained"
    );
    assert!(
        eventually(PATIENCE, || async {
            sink.count() >= written.committed.len()
        })
        .await,
        "only {} of {} delivered",
        sink.count(),
        written.committed.len()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    check(written, &sink.seen())
}

fn spawn_writers(db: &TestDb, spec: Spec) -> tokio::task::JoinHandle<Written> {
    let config = db.config.clone();
    let outbox = db.outbox();
    tokio::spawn(async move { workload::run(&config, &outbox, &spec).await })
}

async fn stop(mut relay: RelayProcess) {
    relay.signal("TERM").await;
    assert_eq!(relay.wait().await, Some(0), "clean exit on SIGTERM");
}

/// Scenario 2: kill -9 at random 200–2000 ms intervals, restarted each time.
async fn kill_9_at_random_intervals(sink: Sink, messages: usize) {
    outbox_tests::init_logging();
    let started = Instant::now();
    let db = TestDb::new().await;
    let env = env_for(&db, &sink, None);
    let writers = spawn_writers(&db, spec(&sink, scale(messages)));
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
    let report = settle(&db, &sink, &written).await;
    let bound = kills * BATCH * (PIPELINE + 1);
    record(
        TMP,
        &format!("{}: kill -9 x{kills} at random intervals", sink.broker()),
        &report,
        started.elapsed(),
        Some(bound),
    );
    assert!(report.is_clean(), "{report}");
    assert!(report.duplicates <= bound, "{report}");
    stop(relay).await;
    sink.cleanup().await;
    db.cleanup().await;
}

#[tokio::test]
async fn s02_amqp_kill_9_at_random_intervals() {
    kill_9_at_random_intervals(Sink::amqp().await, 8_000).await;
}

#[tokio::test]
async fn s02_kafka_kill_9_at_random_intervals() {
    kill_9_at_random_intervals(Sink::kafka(&outbox_tests::kafka_brokers()).await, 4_000).await;
}

/// Scenario 12: a backlog first, then kill -9 while its batches are in
/// flight, up to three times; each restart picks up where the rows are.
async fn kill_9_with_a_backlog(sink: Sink, messages: usize) {
    outbox_tests::init_logging();
    let started = Instant::now();
    let db = TestDb::new().await;
    let env = env_for(&db, &sink, None);
    let written = workload::run(&db.config, &db.outbox(), &spec(&sink, scale(messages))).await;
    let mut kills = 0usize;
    let mut relay = RelayProcess::start(RELAY_BIN, &env);
    for _ in 0..3 {
        let before = sink.count();
        // Kill after the relay has made some progress, not before it connected.
        assert!(
            eventually(PATIENCE, || async {
                sink.count() > before + 300 || db.pending().await == 0
            })
            .await
        );
        if db.pending().await == 0 {
            break;
        }
        relay.kill9().await;
        kills += 1;
        relay = RelayProcess::start(RELAY_BIN, &env);
    }
    assert!(
        kills >= 1,
        "the relay finished before it could be killed; grow the backlog"
    );
    let report = settle(&db, &sink, &written).await;
    let bound = kills * BATCH * (PIPELINE + 1);
    record(
        TMP,
        &format!("{}: kill -9 x{kills} with a backlog", sink.broker()),
        &report,
        started.elapsed(),
        Some(bound),
    );
    assert!(report.is_clean(), "{report}");
    assert!(report.duplicates <= bound, "{report}");
    stop(relay).await;
    sink.cleanup().await;
    db.cleanup().await;
}

#[tokio::test]
async fn s12_amqp_kill_9_with_a_backlog() {
    kill_9_with_a_backlog(Sink::amqp().await, 6_000).await;
}

#[tokio::test]
async fn s12_kafka_kill_9_with_a_backlog() {
    kill_9_with_a_backlog(Sink::kafka(&outbox_tests::kafka_brokers()).await, 10_000).await;
}

/// Scenario 3: the relay dies after the broker confirmed a batch and before the
/// rows were deleted. That batch is delivered twice; nothing is lost.
async fn crash_between_broker_ack_and_delete(sink: Sink) {
    outbox_tests::init_logging();
    let started = Instant::now();
    let db = TestDb::new().await;
    let env = env_for(&db, &sink, None);
    let written = workload::run(&db.config, &db.outbox(), &spec(&sink, scale(3_000))).await;

    let mut crashing = env.clone();
    crashing.push(("OUTBOX_TEST_FAILPOINT", "crash-after-ack:3".into()));
    // One worker, so "the third batch" is one well-defined batch.
    crashing.push(("OUTBOX_PIPELINE", "1".into()));
    let mut relay = RelayProcess::start(RELAY_BIN, &crashing);
    let code = tokio::time::timeout(PATIENCE, relay.wait())
        .await
        .expect("failpoint reached");
    assert_ne!(code, Some(0), "the failpoint aborts the process");

    let relay = RelayProcess::start(RELAY_BIN, &env);
    let report = settle(&db, &sink, &written).await;
    record(
        TMP,
        &format!("{}: crash between broker ack and delete", sink.broker()),
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
    stop(relay).await;
    sink.cleanup().await;
    db.cleanup().await;
}

#[tokio::test]
async fn s03_amqp_crash_between_broker_ack_and_delete() {
    crash_between_broker_ack_and_delete(Sink::amqp().await).await;
}

#[tokio::test]
async fn s03_kafka_crash_between_broker_ack_and_delete() {
    crash_between_broker_ack_and_delete(Sink::kafka(&outbox_tests::kafka_brokers()).await).await;
}

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

/// Scenario 6: a proxy between relay and broker black-holes traffic (accepts,
/// never answers) for 10 s, then resets every connection.
async fn black_holed_then_reset(db: TestDb, sink: Sink, proxy: &Proxy) {
    outbox_tests::init_logging();
    let started = Instant::now();
    let via = format!("127.0.0.1:{}", proxy.port);
    let relay = RelayProcess::start(RELAY_BIN, &env_for(&db, &sink, Some(&via)));
    let writers = spawn_writers(&db, spec(&sink, scale(5_000)));
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
    let report = settle(&db, &sink, &written).await;
    // Only batches in flight when the link went silent can repeat.
    let bound = 2 * BATCH * (PIPELINE + 1);
    record(
        TMP,
        &format!("{}: black-holed 10s, then reset", sink.broker()),
        &report,
        started.elapsed(),
        Some(bound),
    );
    assert!(report.is_clean(), "{report}");
    assert!(report.duplicates <= bound, "{report}");
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
        let v = outbox_relay::ops::status(&db.client, &db.schema)
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

/// Scenario 10: SIGTERM mid-run: the in-flight batch completes, the process
/// exits 0, and the next relay publishes nothing twice.
async fn sigterm_drains_without_duplicates(sink: Sink) {
    outbox_tests::init_logging();
    let started = Instant::now();
    let db = TestDb::new().await;
    let mut env = env_for(&db, &sink, None);
    env.push(("OUTBOX_BATCH_SIZE", "200".into()));
    let written = workload::run(&db.config, &db.outbox(), &spec(&sink, scale(5_000))).await;

    let mut relay = RelayProcess::start(RELAY_BIN, &env);
    assert!(eventually(PATIENCE, || async { sink.count() > 500 }).await);
    relay.signal("TERM").await;
    assert_eq!(relay.wait().await, Some(0), "SIGTERM exits 0");

    let relay = RelayProcess::start(RELAY_BIN, &env);
    let report = settle(&db, &sink, &written).await;
    stop(relay).await;
    record(
        TMP,
        &format!("{}: SIGTERM mid-run", sink.broker()),
        &report,
        started.elapsed(),
        Some(0),
    );
    assert!(report.is_clean(), "{report}");
    assert_eq!(
        report.duplicates, 0,
        "a drained batch is never published twice: {report}"
    );
    sink.cleanup().await;
    db.cleanup().await;
}

#[tokio::test]
async fn s10_amqp_sigterm_drains_without_duplicates() {
    sigterm_drains_without_duplicates(Sink::amqp().await).await;
}

#[tokio::test]
async fn s10_kafka_sigterm_drains_without_duplicates() {
    sigterm_drains_without_duplicates(Sink::kafka(&outbox_tests::kafka_brokers()).await).await;
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
    let writers = spawn_writers(&db, spec(&sink, 3_000));
    assert!(eventually(PATIENCE, || async { sink.count() > 100 }).await);
    proxy.set(Mode::Refuse);
    tokio::time::sleep(Duration::from_secs(3)).await;
    proxy.set(Mode::Pass);
    let written = writers.await.expect("writers");
    assert!(eventually(PATIENCE, || async { db.pending().await == 0 }).await);
    tokio::time::sleep(Duration::from_secs(2)).await;
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
    tokio::time::sleep(Duration::from_secs(3)).await;
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
