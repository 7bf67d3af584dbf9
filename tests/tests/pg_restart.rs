//! Scenario 7: Postgres restarted with `-m immediate` mid-run, and the relay's
//! LISTEN connection terminated. In a test binary of its own: a database
//! restart would disturb every test running beside it.

use std::time::{Duration, Instant};

use outbox_client::Message;
use outbox_tests::amqp::Fixture;
use outbox_tests::check::{check, record};
use outbox_tests::db::TestDb;
use outbox_tests::process::RelayProcess;
use outbox_tests::workload::{self, Spec};
use outbox_tests::{eventually, seen_amqp};

const RELAY_BIN: &str = env!("CARGO_BIN_EXE_outbox-relay-under-test");
const PATIENCE: Duration = Duration::from_secs(240);

async fn pg_restart_immediate() {
    let version = std::fs::read_dir("/etc/postgresql")
        .expect("a Debian postgresql cluster")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .next()
        .expect("a cluster version");
    let status = tokio::process::Command::new("pg_ctlcluster")
        .args([
            "--skip-systemctl-redirect",
            &version,
            "main",
            "restart",
            "-m",
            "immediate",
        ])
        .status()
        .await
        .expect("run pg_ctlcluster");
    assert!(status.success(), "pg_ctlcluster restart failed");
}

#[tokio::test]
async fn postgres_restart_and_listen_termination_lose_nothing() {
    outbox_tests::init_logging();
    let started = Instant::now();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let env = vec![
        ("OUTBOX_SCHEMA", db.schema.to_string()),
        ("OUTBOX_BATCH_SIZE", "100".to_string()),
        ("OUTBOX_RECONNECT_MAX", "1s".to_string()),
        // Polling effectively off: deliveries after the LISTEN connection is
        // killed prove the relay listens again.
        ("OUTBOX_POLL_INTERVAL", "1h".to_string()),
    ];
    let mut relay = RelayProcess::start(RELAY_BIN, &env);

    // 1. The LISTEN connection is terminated; NOTIFY must work again after.
    let first = Message::builder(rabbit.exchange.as_str())
        .payload("a")
        .build()
        .expect("valid");
    db.outbox()
        .enqueue(&db.client, &first)
        .await
        .expect("enqueue");
    assert!(
        eventually(PATIENCE, || async { rabbit.count() >= 1 }).await,
        "not listening at all"
    );
    let killed: i64 = db
        .client
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE application_name = 'outbox-relay-listen'",
            &[],
        )
        .await
        .expect("terminate")
        .get(0);
    assert!(killed >= 1, "no LISTEN connection found to terminate");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let second = Message::builder(rabbit.exchange.as_str())
        .payload("b")
        .build()
        .expect("valid");
    db.outbox()
        .enqueue(&db.client, &second)
        .await
        .expect("enqueue");
    assert!(
        eventually(PATIENCE, || async { rabbit.count() >= 2 }).await,
        "after its LISTEN connection was killed the relay no longer wakes on NOTIFY"
    );

    // 2. Postgres restarted with -m immediate while writers commit.
    let spec = Spec {
        max_commit_delay: Duration::from_millis(10),
        ..Spec::new(&rabbit.exchange, 4, 40, 6_000)
    };
    let writers = {
        let config = db.config.clone();
        let outbox = db.outbox();
        tokio::spawn(async move { workload::run(&config, &outbox, &spec).await })
    };
    assert!(eventually(PATIENCE, || async { rabbit.count() > 500 }).await);
    pg_restart_immediate().await;
    let written = writers.await.expect("writers");

    // The test's own connection died with the server.
    let db = TestDb {
        client: outbox_tests::db::connect(&db.config).await,
        ..db
    };
    // With polling off, rows committed while the relay's LISTEN connection was
    // down are found by the catch-up claim that follows every reconnect.
    assert!(
        eventually(PATIENCE, || async { db.pending().await == 0 }).await,
        "not drained"
    );
    assert!(
        eventually(PATIENCE, || async {
            rabbit.count() >= written.committed.len() + 2
        })
        .await,
        "only {} of {} delivered",
        rabbit.count(),
        written.committed.len() + 2
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let deliveries: Vec<_> = rabbit
        .deliveries()
        .into_iter()
        .filter(|d| d.payload != b"a" && d.payload != b"b")
        .collect();
    let report = check(&written, &seen_amqp(&deliveries));
    record(
        env!("CARGO_TARGET_TMPDIR"),
        &format!(
            "amqp: postgres restart -m immediate ({} indeterminate)",
            written.indeterminate.len()
        ),
        &report,
        started.elapsed(),
        None,
    );
    assert!(report.is_clean(), "{report}");
    relay.signal("TERM").await;
    assert_eq!(relay.wait().await, Some(0));
    rabbit.cleanup().await;
    db.cleanup().await;
}
