//! Scenario 7: Postgres restarted with `-m immediate` mid-run, and the relays'
//! LISTEN connections terminated, with a RabbitMQ and a Kafka relay side by side. In a test binary of its own: a database
//! restart would disturb every test running beside it.

use std::time::{Duration, Instant};

use outbox_client::Message;
use outbox_tests::check::{check, record};
use outbox_tests::db::TestDb;
use outbox_tests::eventually;
use outbox_tests::process::RelayProcess;
use outbox_tests::sink::Sink;
use outbox_tests::workload::{self, Spec};

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

/// One broker's share of the scenario: its own outbox, consumer and relay.
struct Lane {
    db: TestDb,
    sink: Sink,
    relay: RelayProcess,
}

impl Lane {
    async fn start(sink: Sink) -> Lane {
        let db = TestDb::new().await;
        let mut env = vec![
            ("OUTBOX_SCHEMA", db.schema.to_string()),
            ("OUTBOX_BATCH_SIZE", "100".to_string()),
            ("OUTBOX_RECONNECT_MAX", "1s".to_string()),
            // Polling effectively off: deliveries after the LISTEN connection
            // is killed prove the relay listens again.
            ("OUTBOX_POLL_INTERVAL", "1h".to_string()),
            ("OUTBOX_POLL_MIN", "1h".to_string()),
        ];
        // NOTIFY is off by default; this scenario is about the LISTEN path.
        outbox_client::set_notify(&db.client, db.schema.as_str(), true)
            .await
            .expect("notify on");
        env.extend(sink.relay_env(None));
        let relay = RelayProcess::start(RELAY_BIN, &env);
        Lane { db, sink, relay }
    }

    async fn enqueue_marker(&self, payload: &'static str) {
        let m = Message::builder(self.sink.destination())
            .payload(payload)
            .build()
            .expect("valid");
        self.db
            .outbox()
            .enqueue(&self.db.client, &m)
            .await
            .expect("enqueue");
    }
}

/// Scenario 7 on RabbitMQ and Kafka at once: both relays live through the
/// same LISTEN termination and the same restart.
#[tokio::test]
async fn postgres_restart_and_listen_termination_lose_nothing() {
    outbox_tests::init_logging();
    let started = Instant::now();
    let lanes = vec![
        Lane::start(Sink::amqp().await).await,
        Lane::start(Sink::kafka(&outbox_tests::kafka_brokers()).await).await,
    ];

    // 1. The LISTEN connections are terminated; NOTIFY must work again after.
    for lane in &lanes {
        lane.enqueue_marker("a").await;
        assert!(
            eventually(PATIENCE, || async { lane.sink.count() >= 1 }).await,
            "{}: not listening at all",
            lane.sink.broker()
        );
    }
    let killed: i64 = lanes[0]
        .db
        .client
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE application_name = 'outbox-relay-listen'",
            &[],
        )
        .await
        .expect("terminate")
        .get(0);
    assert!(
        killed >= 2,
        "expected both relays' LISTEN connections, found {killed}"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    for lane in &lanes {
        lane.enqueue_marker("b").await;
        assert!(
            eventually(PATIENCE, || async { lane.sink.count() >= 2 }).await,
            "{}: after its LISTEN connection was killed the relay no longer wakes on NOTIFY",
            lane.sink.broker()
        );
    }

    // 2. Postgres restarted with -m immediate while writers commit to both.
    let writers: Vec<_> = lanes
        .iter()
        .map(|lane| {
            let spec = Spec {
                max_commit_delay: Duration::from_millis(10),
                ..Spec::new(lane.sink.destination(), 4, 40, 6_000)
            };
            workload::spawn(&lane.db, spec)
        })
        .collect();
    for lane in &lanes {
        assert!(eventually(PATIENCE, || async { lane.sink.count() > 500 }).await);
    }
    pg_restart_immediate().await;

    for (lane, writers) in lanes.into_iter().zip(writers) {
        let written = writers.await.expect("writers");
        let Lane {
            db,
            sink,
            mut relay,
        } = lane;
        // The test's own connection died with the server.
        let db = TestDb {
            client: outbox_tests::db::connect(&db.config).await,
            ..db
        };
        // With polling off, rows committed while the relay's LISTEN connection
        // was down are found by the catch-up claim that follows every reconnect.
        assert!(
            eventually(PATIENCE, || async { db.pending().await == 0 }).await,
            "{}: not drained",
            sink.broker()
        );
        assert!(
            eventually(PATIENCE, || async {
                sink.count() >= written.committed.len() + 2
            })
            .await,
            "{}: only {} of {} delivered",
            sink.broker(),
            sink.count(),
            written.committed.len() + 2
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        let seen: Vec<_> = sink
            .seen()
            .into_iter()
            .filter(|d| d.payload != b"a" && d.payload != b"b")
            .collect();
        let report = check(&written, &seen);
        record(
            env!("CARGO_TARGET_TMPDIR"),
            &format!(
                "{}: postgres restart -m immediate ({} indeterminate)",
                sink.broker(),
                written.indeterminate.len()
            ),
            &report,
            started.elapsed(),
            None,
        );
        assert!(report.is_clean(), "{}: {report}", sink.broker());
        relay.signal("TERM").await;
        assert_eq!(relay.wait().await, Some(0));
        sink.cleanup().await;
        db.cleanup().await;
    }
}
