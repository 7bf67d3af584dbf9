//! Metrics, probes and the healthcheck while the broker comes and goes, and
//! the database-wide gauges exported by exactly one replica.

use std::time::Duration;

use outbox_client::Message;
use outbox_tests::amqp::Fixture;
use outbox_tests::db::TestDb;
use outbox_tests::http::{get, sample, scrape};
use outbox_tests::proxy::{Mode, Proxy};
use outbox_tests::{eventually, free_port};
use tokio::process::Command;

use super::{PATIENCE, RELAY_BIN};

/// The broker connection gauge's sample line.
const BROKER_UP: &str = "outbox_connection_up{target=\"broker\"}";

/// Whether the relay on `port` comes to export `value` for `prefix` (see
/// [`sample`]) within [`PATIENCE`].
async fn sample_becomes(port: u16, prefix: &str, value: f64) -> bool {
    eventually(PATIENCE, || async {
        sample(&scrape(port).await, prefix) == Some(value)
    })
    .await
}

#[tokio::test]
async fn metrics_move_and_readiness_ignores_the_broker() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let proxy = Proxy::start("127.0.0.1:5672").await;
    proxy.set(Mode::Refuse);
    let port = free_port();
    let mut relay = Command::new(RELAY_BIN)
        .arg("run")
        .env("OUTBOX_DATABASE_URL", outbox_tests::pg_url())
        .env(
            "OUTBOX_AMQP_URL",
            format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port),
        )
        .env("OUTBOX_SCHEMA", db.schema.as_str())
        .env("OUTBOX_HTTP_ADDR", format!("127.0.0.1:{port}"))
        .env("OUTBOX_CONFIRM_TIMEOUT", "3s")
        .env("OUTBOX_HOLD_LIMIT", "10s")
        .env("OUTBOX_LOG", "info")
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("relay");
    let mut err_pipe = relay.stderr.take().expect("stderr");
    let log_task = tokio::spawn(async move {
        let mut v = Vec::new();
        let _ = tokio::io::AsyncReadExt::read_to_end(&mut err_pipe, &mut v).await;
        String::from_utf8_lossy(&v).into_owned()
    });
    assert!(
        eventually(PATIENCE, || async {
            get(port, "/healthz").await.is_some_and(|(s, _)| s == 200)
        })
        .await,
        "/healthz never answered"
    );
    // The image's HEALTHCHECK: the relay's own subcommand, no curl.
    let health = Command::new(RELAY_BIN)
        .args(["healthcheck", "--http-addr", &format!("0.0.0.0:{port}")])
        .output()
        .await
        .expect("healthcheck");
    assert_eq!(health.status.code(), Some(0), "{health:?}");
    // The broker is unreachable from the start: alive and ready (as a
    // sidecar its readiness is the app's), the broker gauge at 0, backlog
    // grows.
    let broker_up = |m: &str| sample(m, BROKER_UP);
    assert!(
        eventually(PATIENCE, || async {
            let m = scrape(port).await;
            broker_up(&m) == Some(0.0) && get(port, "/readyz").await.is_some_and(|(s, _)| s == 200)
        })
        .await,
        "the broker gauge never showed the broker down, or the relay was not ready"
    );
    let messages: Vec<Message> = (0..2000)
        .map(|i| {
            Message::builder(rabbit.exchange.as_str())
                .key(format!("k{}", i % 20))
                .json(&i)
                .build()
                .expect("valid")
        })
        .collect();
    db.outbox()
        .enqueue_batch(&db.client, &messages)
        .await
        .expect("enqueue");
    let backlog_line = format!(
        "outbox_backlog_messages{{destination=\"{}\"}}",
        rabbit.exchange
    );
    assert!(
        sample_becomes(port, &backlog_line, 2000.0).await,
        "backlog gauge never showed the 2000 waiting rows"
    );

    proxy.set(Mode::Pass);
    assert!(
        sample_becomes(port, BROKER_UP, 1.0).await,
        "the broker gauge never came back up"
    );
    assert!(eventually(PATIENCE, || async { rabbit.count() >= 2000 }).await);
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let (moved, last) = loop {
        let m = scrape(port).await;
        let published = sample(
            &m,
            &format!(
                "outbox_messages_total{{destination=\"{}\",result=\"published\"}}",
                rabbit.exchange
            ),
        );
        let latencies = sample(&m, "outbox_commit_to_confirm_seconds_count");
        let ok = published == Some(2000.0)
            && latencies == Some(2000.0)
            && sample(&m, &backlog_line) == Some(0.0);
        if ok || tokio::time::Instant::now() > deadline {
            break (ok, m);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        moved,
        "counters, histogram or backlog gauge did not move as expected:\n{last}"
    );
    for name in outbox_relay::metrics::ALL {
        assert!(last.contains(name), "metric {name} not exported:\n{last}");
        assert!(
            last.contains(&format!("# HELP {name} ")),
            "metric {name} has no HELP line:\n{last}"
        );
    }
    assert!(
        last.contains(&format!(
            "outbox_build_info{{version=\"{}\",broker=\"amqp\"}} 1",
            env!("CARGO_PKG_VERSION")
        )) || last.contains(&format!(
            "outbox_build_info{{broker=\"amqp\",version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        )),
        "build info:\n{last}"
    );
    // The outage failed batches, counted once per batch; messages_total
    // counts what happened to messages, never a batch's retries.
    assert!(
        sample(&last, "outbox_batch_failures_total").is_some_and(|n| n >= 1.0),
        "failed batches counted:\n{last}"
    );
    assert!(!last.contains("batch_failed"), "{last}");
    // Every published batch first waited for its rows to be durable.
    assert!(
        sample(&last, "outbox_durable_wait_seconds_count").is_some_and(|n| n >= 1.0),
        "durability waits recorded:\n{last}"
    );
    assert_eq!(
        sample(&last, "outbox_database_gauges_exporter"),
        Some(1.0),
        "the only replica exports the database-wide gauges"
    );

    // Broker unreachable mid-run: the gauge drops within seconds, and the
    // relay stays alive and ready; back: the gauge rises again.
    proxy.set(Mode::Refuse);
    assert!(
        sample_becomes(port, BROKER_UP, 0.0).await,
        "the broker gauge did not drop with the broker unreachable"
    );
    assert_eq!(
        get(port, "/readyz").await.map(|(s, _)| s),
        Some(200),
        "a broker outage must not make the relay (and a sidecar's pod) unready"
    );
    assert_eq!(
        get(port, "/healthz").await.map(|(s, _)| s),
        Some(200),
        "alive all the same"
    );
    proxy.set(Mode::Pass);
    assert!(
        sample_becomes(port, BROKER_UP, 1.0).await,
        "the broker gauge did not come back"
    );

    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(relay.id().expect("pid").to_string())
        .status()
        .await;
    assert_eq!(relay.wait().await.ok().and_then(|s| s.code()), Some(0));
    let health = Command::new(RELAY_BIN)
        .args(["healthcheck", "--http-addr", &format!("127.0.0.1:{port}")])
        .output()
        .await
        .expect("healthcheck");
    assert_eq!(
        health.status.code(),
        Some(1),
        "nothing answers now: {health:?}"
    );
    // With the endpoints off (OUTBOX_HTTP_ADDR=off, often inherited from
    // the relay's own environment) the check says unhealthy, 1: it said 2,
    // a usage error, which Docker reserves for health checks.
    let health = Command::new(RELAY_BIN)
        .args(["healthcheck"])
        .env("OUTBOX_HTTP_ADDR", "off")
        .output()
        .await
        .expect("healthcheck");
    assert_eq!(health.status.code(), Some(1), "{health:?}");
    assert!(
        String::from_utf8_lossy(&health.stderr).contains("--http-addr is off"),
        "{health:?}"
    );

    // Two outages, each logged once when it began and once when it ended,
    // however many workers and probes hit it: no flood of retries.
    let log = log_task.await.expect("log");
    let count = |needle: &str| log.lines().filter(|l| l.contains(needle)).count();
    assert_eq!(
        count("broker unreachable"),
        2,
        "one line per outage:\n{log}"
    );
    assert_eq!(
        count("broker reachable again"),
        2,
        "one line per recovery:\n{log}"
    );
    let warnings = log.lines().filter(|l| l.contains("WARN")).count();
    assert!(warnings <= 4, "{warnings} warnings for two outages:\n{log}");
    assert!(
        !log.contains('\u{1b}'),
        "colour escapes in a piped log:\n{log}"
    );
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// Backlog and dead-letter gauges describe the whole outbox: with several
/// replicas exactly one exports them (so sums across replicas are right),
/// and when it dies another takes over.
#[tokio::test]
async fn one_replica_exports_the_database_wide_gauges_and_another_takes_over() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let ports = [free_port(), free_port()];
    let mut relays: Vec<Option<outbox_tests::process::RelayProcess>> = ports
        .iter()
        .map(|port| {
            Some(outbox_tests::process::RelayProcess::start(
                RELAY_BIN,
                &[
                    ("OUTBOX_SCHEMA", db.schema.as_str().to_owned()),
                    ("OUTBOX_HTTP_ADDR", format!("127.0.0.1:{port}")),
                ],
            ))
        })
        .collect();
    let exporters = |ms: &[Option<String>]| -> Vec<usize> {
        ms.iter()
            .enumerate()
            .filter(|(_, m)| {
                m.as_deref().is_some_and(|m| {
                    sample(m, "outbox_database_gauges_exporter") == Some(1.0)
                        && sample(m, "outbox_dead_letter_messages").is_some()
                })
            })
            .map(|(i, _)| i)
            .collect()
    };
    let scrape = |alive: Vec<bool>| async move {
        let mut out = Vec::new();
        for (i, port) in ports.iter().enumerate() {
            out.push(if alive[i] {
                get(*port, "/metrics").await.map(|(_, m)| m)
            } else {
                None
            });
        }
        out
    };
    // Both up and scraped, one of them the exporter.
    let mut holder = None;
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while tokio::time::Instant::now() < deadline {
        let ms = scrape(vec![true, true]).await;
        let both = ms.iter().all(|m| {
            m.as_deref()
                .is_some_and(|m| m.contains("outbox_database_gauges_exporter"))
        });
        let ex = exporters(&ms);
        if both && ex.len() == 1 {
            // The other one shows no database-wide series at all.
            let other = ms[1 - ex[0]].as_deref().unwrap_or_default();
            for name in outbox_relay::metrics::DATABASE_WIDE {
                assert!(
                    !other.lines().any(|l| l.starts_with(name)),
                    "{name} exported by the second replica too:\n{other}"
                );
            }
            holder = Some(ex[0]);
            break;
        }
        assert!(ex.len() <= 1, "two replicas export the database gauges");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let holder = holder.expect("exactly one replica exports the database-wide gauges");
    if let Some(r) = relays[holder].take() {
        r.kill9().await;
    }
    let survivor = 1 - holder;
    let mut alive = vec![false, false];
    alive[survivor] = true;
    assert!(
        eventually(PATIENCE, || async {
            exporters(&scrape(alive.clone()).await) == vec![survivor]
        })
        .await,
        "the surviving replica never took over the database-wide gauges"
    );
    drop(relays);
    db.cleanup().await;
}

/// Two outbox schemas of one database whose exporter locks, 32-bit hashes
/// of their names, collide (`tenant_17784` and `tenant_58492`): one relay
/// held the lock for both, and the other outbox never exported its backlog
/// and dead-letter gauges, with `sum(outbox_database_gauges_exporter)`
/// still 1. The schema migrated second now takes a lock of its own.
#[tokio::test]
async fn outboxes_whose_exporter_locks_collide_each_export_their_gauges() {
    outbox_tests::init_logging();
    let admin = TestDb::new().await;
    let (db_name, config) = outbox_tests::db::create_database(&admin, "exporters").await;
    let url = format!("postgres://postgres@127.0.0.1:5432/{db_name}");
    let schemas = ["tenant_17784", "tenant_58492"];
    for schema in schemas {
        let mut client = outbox_tests::db::connect(&config).await;
        outbox_client::migrate(&mut client, schema)
            .await
            .expect("migrate");
    }
    let ports = [free_port(), free_port()];
    let mut relays: Vec<_> = schemas
        .iter()
        .zip(ports)
        .map(|(schema, port)| {
            outbox_tests::process::RelayProcess::start(
                RELAY_BIN,
                &[
                    ("OUTBOX_SCHEMA", (*schema).to_owned()),
                    ("OUTBOX_DATABASE_URL", url.clone()),
                    ("OUTBOX_HTTP_ADDR", format!("127.0.0.1:{port}")),
                ],
            )
        })
        .collect();
    let exporting = |m: &str| {
        sample(m, "outbox_database_gauges_exporter") == Some(1.0)
            && sample(m, "outbox_dead_letter_messages").is_some()
    };
    let both = eventually(Duration::from_secs(60), || async {
        let mut all = true;
        for port in ports {
            all &= get(port, "/metrics")
                .await
                .is_some_and(|(_, m)| exporting(&m));
        }
        all
    })
    .await;
    let mut seen = Vec::new();
    for port in ports {
        seen.push(
            get(port, "/metrics")
                .await
                .is_some_and(|(_, m)| exporting(&m)),
        );
    }
    for relay in &mut relays {
        relay.signal("TERM").await;
        relay.wait().await;
    }
    outbox_tests::db::drop_database(&admin, &db_name).await;
    admin.cleanup().await;
    assert!(both, "exporting, by schema {schemas:?}: {seen:?}");
}
