//! RabbitMQ stopped for 10 s mid-run. In a test binary of its own: stopping the
//! broker would disturb every other test running beside it.

use std::time::Duration;

use outbox_tests::amqp::{BrokerStopped, Fixture, MemoryAlarm};
use outbox_tests::check::judge;
use outbox_tests::db::TestDb;
use outbox_tests::sink::Sink;
use outbox_tests::workload::{self, Spec};
use outbox_tests::{eventually, fast_settings, InProcessRelay};

/// The two tests stop the same broker: one at a time.
static BROKER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test]
async fn broker_stopped_for_10s_then_everything_is_delivered() {
    let _broker = BROKER.lock().await;
    outbox_tests::init_logging();
    let started = std::time::Instant::now();
    let db = TestDb::new().await;
    let sink = Sink::amqp().await;
    let relay = InProcessRelay::amqp(&db, fast_settings());

    // Writers keep committing through the outage.
    let spec = Spec {
        max_commit_delay: Duration::from_millis(20),
        ..Spec::new(sink.destination(), 4, 40, 6_000)
    };
    let writers = workload::spawn(&db, spec);
    assert!(eventually(Duration::from_secs(60), || async { sink.count() > 200 }).await);

    let stopped = BrokerStopped::stop().await;
    let outage = std::time::Instant::now();
    let failures_before = relay
        .stats
        .counted(outbox_relay::health::Event::BatchFailed);
    // A batch at the broker when it stops fails whole, or, when some of its
    // confirms came first, leaves the rest unanswered and set aside: only
    // the first counts as a failed batch. Either way, and with no batch at
    // the broker, the relay reports the broker down.
    let seen_down = eventually(Duration::from_secs(10), || async {
        relay.stats.broker_down().is_some()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(10).saturating_sub(outage.elapsed())).await;
    let backlog_during_outage = db.pending().await;
    stopped.start().await;

    let written = writers.await.expect("writers");
    let report = sink.settle(&db, &written, Duration::from_secs(120)).await;
    println!(
        "broker outage: {report}; backlog during outage {backlog_during_outage}; failed batches {}",
        relay
            .stats
            .counted(outbox_relay::health::Event::BatchFailed)
            - failures_before
    );
    judge(
        env!("CARGO_TARGET_TMPDIR"),
        "amqp: rabbitmq stopped 10s",
        &report,
        started,
        None,
    );
    assert!(
        backlog_during_outage > 0,
        "the outage should have built a backlog in Postgres"
    );
    assert!(seen_down, "the relay should have seen the broker down");
    // The relay survived the outage: it still stops cleanly on request.
    relay.stop().await;
    sink.cleanup().await;
    db.cleanup().await;
}

/// Broker down for 60 s with a backlog waiting: outage failures are not counted
/// as attempts, nothing is dead-lettered, the relay does not spin, and
/// everything goes out once the broker is back.
#[tokio::test]
async fn broker_down_60s_counts_no_attempts_and_does_not_spin() {
    let _broker = BROKER.lock().await;
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let env = vec![
        ("OUTBOX_SCHEMA", db.schema.to_string()),
        ("OUTBOX_MAX_ATTEMPTS", "3".to_string()),
        ("OUTBOX_RETRY_BASE", "100ms".to_string()),
        ("OUTBOX_RECONNECT_MAX", "2s".to_string()),
    ];
    let mut relay = outbox_tests::process::RelayProcess::start(
        env!("CARGO_BIN_EXE_outbox-relay-under-test"),
        &env,
    );
    let first: Vec<outbox_client::Message> = (0..100)
        .map(|i| {
            outbox_client::Message::builder(rabbit.exchange.as_str())
                .json(&i)
                .build()
                .expect("valid")
        })
        .collect();
    db.outbox()
        .enqueue_batch(&db.client, &first)
        .await
        .expect("enqueue");
    assert!(eventually(Duration::from_secs(60), || async { rabbit.count() >= 100 }).await);

    let updated_before = rows_updated(&db).await;
    let stopped = BrokerStopped::stop().await;
    let cpu_before = relay.cpu_time().expect("relay running");
    let wall = std::time::Instant::now();
    let backlog: Vec<outbox_client::Message> = (0..2000)
        .map(|i| {
            outbox_client::Message::builder(rabbit.exchange.as_str())
                .key(format!("k{}", i % 10))
                .json(&i)
                .build()
                .expect("valid")
        })
        .collect();
    db.outbox()
        .enqueue_batch(&db.client, &backlog)
        .await
        .expect("enqueue");
    tokio::time::sleep(Duration::from_secs(60)).await;
    let cpu = relay.cpu_time().expect("relay still running") - cpu_before;
    let elapsed = wall.elapsed();
    let row = db
        .client
        .query_one(
            &format!(
                "SELECT coalesce(max(attempts), 0), count(*), \
                        (SELECT count(*) FROM {s}.dead_letters), count(last_error) \
                 FROM {s}.messages",
                s = db.schema.quoted()
            ),
            &[],
        )
        .await
        .expect("counts");
    let (max_attempts, pending, dead, with_error): (i32, i64, i64, i64) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    // Counted by Postgres as each session's statistics reach it: at least
    // once a second from a busy session, within 10 s from an idle one.
    let updated = rows_updated(&db).await - updated_before;
    stopped.start().await;

    println!(
        "broker down {:?}: relay used {:?} of CPU ({:.1}% of one core); {pending} rows waited, \
         {with_error} with the outage recorded as their last error; {updated} row versions \
         written",
        elapsed,
        cpu,
        100.0 * cpu.as_secs_f64() / elapsed.as_secs_f64()
    );
    assert_eq!(pending, 2000, "the backlog waits in Postgres");
    assert_eq!(
        max_attempts, 0,
        "an outage must not count as delivery attempts"
    );
    assert_eq!(
        dead, 0,
        "nothing may be dead-lettered because the broker was down"
    );
    // After its first failed batch, a worker asks the broker before it
    // claims again: a claim while the broker is down writes the failure
    // onto every row of its batch, and the table fills with dead row
    // versions for as long as the outage lasts. So: one failed batch for
    // each of the default 4 workers, each writing at most every waiting row
    // (its own, and those it holds behind its keys). Claiming on through
    // the outage wrote 86,500.
    assert!(
        updated <= 4 * 2000,
        "{updated} rows updated during a 60 s outage: the relay kept claiming batches \
         it could not publish"
    );
    // A busy loop would burn a whole core; waiting with backoff costs little.
    assert!(
        cpu < elapsed / 4,
        "relay spun during the outage: {cpu:?} CPU in {elapsed:?}"
    );
    assert!(
        eventually(Duration::from_secs(120), || async {
            db.pending().await == 0
        })
        .await
    );
    assert!(
        eventually(Duration::from_secs(120), || async {
            rabbit.count() >= 2100
        })
        .await
    );
    relay.signal("TERM").await;
    assert_eq!(relay.wait().await, Some(0));
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// The alarm tests' end: waits for the writers and for every message they
/// committed, judges the delivery against `bound` (one set of in-flight
/// batches goes out twice at most) as `scenario`, and stops and cleans up.
async fn settle_judge_and_clean_up(
    scenario: &str,
    started: std::time::Instant,
    bound: usize,
    writers: tokio::task::JoinHandle<workload::Written>,
    relay: InProcessRelay,
    sink: Sink,
    db: TestDb,
) {
    let written = writers.await.expect("writers");
    let report = sink.settle(&db, &written, Duration::from_secs(120)).await;
    judge(
        env!("CARGO_TARGET_TMPDIR"),
        scenario,
        &report,
        started,
        Some(bound),
    );
    relay.stop().await;
    sink.cleanup().await;
    db.cleanup().await;
}

/// Batches of 100, three at the broker at once, and a 6 s hold limit: a
/// blocked batch ends at its 3 s deadline, well before the 10 s confirm
/// timeout. Returned with the duplicate bound: one set of in-flight batches.
fn alarm_settings() -> (outbox_relay::Settings, usize) {
    let settings = outbox_relay::Settings {
        batch_size: 100,
        pipeline: 3,
        hold_limit: Duration::from_secs(6),
        ..fast_settings()
    };
    let bound = settings.batch_size as usize * (settings.pipeline + 1);
    (settings, bound)
}

/// A memory alarm raised while batches are in flight: RabbitMQ blocks every
/// publishing connection and stops reading from it, so confirms never come
/// and `basic_publish` can wait with them. Each batch must still end within
/// half the hold limit (abandoned, its rows unlocked, never held past the
/// point where another replica could take them), batches claimed while the
/// connection is blocked must not be sent at all, and once the alarm clears
/// everything arrives with duplicates within one set of in-flight batches.
/// All the while the broker shows as down, from the first batch that found
/// it blocked. Before the per-batch deadline a batch waited on the confirm
/// timeout alone, which nothing tied to the hold limit.
#[tokio::test]
async fn memory_alarm_mid_run_abandons_batches_in_time_and_loses_nothing() {
    let _broker = BROKER.lock().await;
    outbox_tests::init_logging();
    let started = std::time::Instant::now();
    let db = TestDb::new().await;
    let sink = Sink::amqp().await;
    // Only the batch deadline can end a blocked batch in time.
    let (settings, bound) = alarm_settings();
    let relay = InProcessRelay::amqp(&db, settings);
    let spec = Spec {
        max_commit_delay: Duration::from_millis(20),
        ..Spec::new(sink.destination(), 4, 40, 6_000)
    };
    let writers = workload::spawn(&db, spec);
    assert!(eventually(Duration::from_secs(60), || async { sink.count() > 300 }).await);
    // The relay's sessions, by backend pid. A batch held past the hold limit
    // has its session ended by the server (idle_in_transaction_session_timeout)
    // and the relay reconnects under a new pid. Each as "pid started-at",
    // so that a failure shows which session went, which came, and when.
    // Only this process's: a relay of another test process on the same
    // database (one run beside the suite) ended its sessions in this window
    // and failed the test.
    let sessions = || async {
        let mut pids: Vec<String> = db
            .client
            .query(
                "SELECT pid::text || ' ' || backend_start::text \
                 FROM pg_stat_activity WHERE application_name = 'outbox-relay' \
                 AND datname = current_database() AND client_port = ANY($1)",
                &[&outbox_tests::process::own_tcp_ports()],
            )
            .await
            .expect("activity")
            .iter()
            .map(|r| r.get(0))
            .collect();
        pids.sort_unstable();
        pids
    };
    let before = sessions().await;
    assert!(!before.is_empty(), "the relay's sessions were not found");
    let alarm = MemoryAlarm::raise().await;
    // Long enough for several batch deadlines and hold limits to pass, and
    // for the broker probe (every 2 s) to run several times. Once a batch
    // has found the connection blocked, the broker stays reported down,
    // since that moment, for as long as the alarm lasts: an operator's
    // "down for more than N minutes" must be able to fire.
    // Every TCP port this process (the relay, the sink) uses during the
    // alarm, including those of connections it has since let go.
    let ports = std::sync::Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
    let watch = tokio::spawn({
        let ports = std::sync::Arc::clone(&ports);
        async move {
            loop {
                ports
                    .lock()
                    .expect("ports")
                    .extend(outbox_tests::process::own_tcp_ports());
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    });
    relay
        .assert_broker_stays_down(Duration::from_secs(15))
        .await;
    let during = sessions().await;
    watch.abort();
    // The relay's connections the broker blocked: one. A connection given
    // up at each cut could not even send its close (lapin writes nothing
    // on a blocked connection), and the broker, which stops reading from
    // it, kept it with the batches queued in it, while a new connection
    // took the next batches until it too was blocked.
    let ports: Vec<i32> = ports.lock().expect("ports").iter().copied().collect();
    let blocked = outbox_tests::amqp::blocked_connections_from(&ports).await;
    alarm.clear().await;
    assert_eq!(
        blocked, 1,
        "blocked connections of the relay's: one, the connection its cut batch found blocked, kept; more were left behind by cut batches, to deliver their batches again once the alarm cleared"
    );
    assert_eq!(
        before, during,
        "a relay session was ended by the server: a batch was held past the hold limit"
    );
    settle_judge_and_clean_up(
        "amqp: memory alarm 15s",
        started,
        bound,
        writers,
        relay,
        sink,
        db,
    )
    .await;
}

/// A relay that starts while RabbitMQ is already in a memory alarm: its
/// first connection is not known to be blocked until it publishes, so its
/// first batches go out and wait. They must end at their deadline like any
/// other, the broker must show as down for the rest of the alarm, and once
/// the alarm clears everything arrives, with duplicates within one set of
/// in-flight batches.
#[tokio::test]
async fn a_relay_started_during_a_memory_alarm_waits_it_out_and_loses_nothing() {
    let _broker = BROKER.lock().await;
    outbox_tests::init_logging();
    let started = std::time::Instant::now();
    let db = TestDb::new().await;
    let sink = Sink::amqp().await;
    let (settings, bound) = alarm_settings();
    let alarm = MemoryAlarm::raise().await;
    let spec = Spec {
        max_commit_delay: Duration::from_millis(20),
        ..Spec::new(sink.destination(), 4, 40, 2_000)
    };
    let writers = workload::spawn(&db, spec);
    let relay = InProcessRelay::amqp(&db, settings);
    // Longer than a batch deadline (3 s) and several probes (every 2 s).
    relay
        .assert_broker_stays_down(Duration::from_secs(10))
        .await;
    alarm.clear().await;
    settle_judge_and_clean_up(
        "amqp: relay started in a memory alarm",
        started,
        bound,
        writers,
        relay,
        sink,
        db,
    )
    .await;
}

/// Row versions written into the test's outbox table by updates, as
/// Postgres has counted them so far.
async fn rows_updated(db: &TestDb) -> i64 {
    db.client
        .query_one(
            "SELECT coalesce(sum(n_tup_upd), 0)::bigint FROM pg_stat_user_tables \
             WHERE schemaname = $1 AND relname = 'messages'",
            &[&db.schema.as_str()],
        )
        .await
        .expect("table statistics")
        .get(0)
}

/// The relay's lapin threads (one per connection, and one per connection
/// attempt under way).
fn lapin_threads(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|tasks| {
            tasks
                .flatten()
                .filter(|t| {
                    std::fs::read_to_string(t.path().join("comm"))
                        .is_ok_and(|c| c.starts_with("lapin-io-loop"))
                })
                .count()
        })
        .unwrap_or(0)
}

/// A broker link that accepts connections and never answers (a black hole,
/// a proxy whose backend is gone): every connection attempt runs into its
/// 10 s timeout. Each attempt used to leave its lapin thread and socket
/// behind for the life of the process, and the set-up tasks of the
/// batches and probes that had stopped waiting queued one attempt after
/// another, so SIGTERM waited minutes for them (208 s seen). Rows written
/// meanwhile are all delivered once the link answers.
#[tokio::test]
async fn connection_attempts_into_a_black_hole_leave_nothing_behind() {
    let _broker = BROKER.lock().await;
    use outbox_tests::process::RelayProcess;
    use outbox_tests::proxy::{Mode, Proxy};
    const RELAY_BIN: &str = env!("CARGO_BIN_EXE_outbox-relay-under-test");
    outbox_tests::init_logging();
    let started = std::time::Instant::now();
    let db = TestDb::new().await;
    let sink = Sink::amqp().await;
    let link = Proxy::start("127.0.0.1:5672").await;
    link.set(Mode::BlackHole);
    let mut env = vec![("OUTBOX_SCHEMA", db.schema.to_string())];
    env.extend(sink.relay_env(Some(&format!("127.0.0.1:{}", link.port))));
    let mut relay = RelayProcess::start(RELAY_BIN, &env);
    let written = workload::run(
        &db.config,
        &db.outbox(),
        &Spec::new(sink.destination(), 2, 20, 300),
    )
    .await;
    // Past four connect timeouts.
    tokio::time::sleep(Duration::from_secs(45)).await;
    let attempts = link.accepted();
    let threads = lapin_threads(relay.pid());
    assert!(attempts >= 4, "only {attempts} connection attempts");
    // The attempt under way, and one whose thread is ending.
    assert!(
        threads <= 2,
        "{threads} lapin threads after {attempts} connection attempts"
    );
    relay.signal("TERM").await;
    let stopped = tokio::time::timeout(Duration::from_secs(60), relay.wait()).await;
    assert_eq!(stopped, Ok(Some(0)), "SIGTERM did not stop the relay");

    link.set(Mode::Pass);
    let mut relay = RelayProcess::start(RELAY_BIN, &env);
    let report = sink.settle(&db, &written, Duration::from_secs(120)).await;
    judge(
        env!("CARGO_TARGET_TMPDIR"),
        "amqp: connection attempts into a black hole, then delivered",
        &report,
        started,
        Some(0),
    );
    relay.signal("TERM").await;
    assert_eq!(relay.wait().await, Some(0));
    sink.cleanup().await;
    db.cleanup().await;
}

/// A second SIGTERM (or Ctrl-C) during the shutdown grace stops the relay
/// at once (exit 130), and what was in flight goes again from the outbox.
/// The second signal was ignored: the relay sat out the whole grace.
#[tokio::test]
async fn a_second_signal_stops_at_once_and_loses_nothing() {
    let _broker = BROKER.lock().await;
    use outbox_tests::process::RelayProcess;
    use outbox_tests::proxy::{Mode, Proxy};
    const RELAY_BIN: &str = env!("CARGO_BIN_EXE_outbox-relay-under-test");
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let link = Proxy::start("127.0.0.1:5672").await;
    let env = vec![
        ("OUTBOX_SCHEMA", db.schema.to_string()),
        (
            "OUTBOX_AMQP_URL",
            format!("amqp://guest:guest@127.0.0.1:{}/%2f", link.port),
        ),
        ("OUTBOX_CONFIRM_TIMEOUT", "300s".to_string()),
        ("OUTBOX_HOLD_LIMIT", "900s".to_string()),
        ("OUTBOX_SHUTDOWN_GRACE", "600s".to_string()),
    ];
    let mut relay = RelayProcess::start(RELAY_BIN, &env);
    let warm = outbox_client::Message::builder(rabbit.exchange.as_str())
        .json(&0)
        .build()
        .expect("valid");
    db.outbox()
        .enqueue(&db.client, &warm)
        .await
        .expect("enqueue");
    assert!(
        eventually(Duration::from_secs(60), || async { rabbit.count() >= 1 }).await,
        "the relay never published"
    );
    // The broker's answers stop: the next batch waits for its confirms.
    link.set(Mode::Strand);
    let stuck = outbox_client::Message::builder(rabbit.exchange.as_str())
        .json(&1)
        .build()
        .expect("valid");
    db.outbox()
        .enqueue(&db.client, &stuck)
        .await
        .expect("enqueue");
    let in_flight = format!(
        "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
         WHERE c.relname = 'messages' AND c.relnamespace = '{}'::regnamespace \
         AND l.mode = 'RowShareLock'",
        db.schema.as_str()
    );
    assert!(
        eventually(Duration::from_secs(60), || async {
            db.client
                .query_one(in_flight.as_str(), &[])
                .await
                .expect("pg_locks")
                .get::<_, i64>(0)
                > 0
        })
        .await,
        "the batch was never claimed"
    );
    relay.signal("TERM").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        relay.exited().is_none(),
        "the first signal waits for the batch"
    );
    relay.signal("TERM").await;
    let stopped = tokio::time::timeout(Duration::from_secs(60), relay.wait()).await;
    assert_eq!(
        stopped,
        Ok(Some(130)),
        "the second signal did not stop the relay (grace 600 s)"
    );
    // Nothing lost: the batch goes again with the next relay.
    link.set(Mode::Pass);
    let link2 = Proxy::start("127.0.0.1:5672").await;
    let mut env = env;
    env[1].1 = format!("amqp://guest:guest@127.0.0.1:{}/%2f", link2.port);
    let mut relay = RelayProcess::start(RELAY_BIN, &env);
    assert!(
        eventually(Duration::from_secs(60), || async {
            db.pending().await == 0 && rabbit.count() >= 2
        })
        .await,
        "the batch in flight at the second signal never went out"
    );
    relay.signal("TERM").await;
    assert_eq!(relay.wait().await, Some(0));
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// Enqueues one message and waits until the relay has published and
/// settled it.
async fn publishes_one(db: &TestDb, rabbit: &Fixture) {
    let message = outbox_client::Message::builder(rabbit.exchange.as_str())
        .json(&0)
        .build()
        .expect("valid");
    db.outbox()
        .enqueue(&db.client, &message)
        .await
        .expect("enqueue");
    assert!(
        eventually(Duration::from_secs(60), || async {
            rabbit.count() >= 1 && db.pending().await == 0
        })
        .await,
        "the relay never published"
    );
}

/// SIGTERM while Postgres is stranded: a balancer whose backend vanished
/// (HAProxy in front of a failing-over cluster) accepts connections and
/// answers nothing. The relay's waits on Postgres are bounded by the hold
/// limit, not by shutdown: the first signal was ignored until they ran out,
/// at start-up (waiting for the schema) and while running (sessions
/// reconnecting), and an orchestrator's kill came first. Both now stop
/// within the shutdown grace. Nothing is in flight in either case: a batch
/// stranded with its rows is the grace's to end (see the second-signal
/// test).
#[tokio::test]
async fn sigterm_while_postgres_is_stranded_stops_within_the_grace() {
    let _broker = BROKER.lock().await;
    use outbox_tests::process::RelayProcess;
    use outbox_tests::proxy::{Mode, Proxy};
    const RELAY_BIN: &str = env!("CARGO_BIN_EXE_outbox-relay-under-test");
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let through = |link: &Proxy| {
        let base = outbox_tests::pg_url();
        let (head, tail) = base.rsplit_once('/').expect("a database in the url");
        let host = head.rsplit_once('@').map_or(head, |(_, h)| h);
        format!(
            "{}/{tail}",
            head.replacen(host, &format!("127.0.0.1:{}", link.port), 1)
        )
    };
    let env = |link: &Proxy| {
        vec![
            ("OUTBOX_SCHEMA", db.schema.to_string()),
            ("OUTBOX_DATABASE_URL", through(link)),
            ("OUTBOX_CONFIRM_TIMEOUT", "300s".to_string()),
            ("OUTBOX_HOLD_LIMIT", "900s".to_string()),
            ("OUTBOX_SHUTDOWN_GRACE", "5s".to_string()),
        ]
    };

    // At start-up: stranded before the relay's first connection.
    let link = Proxy::start("127.0.0.1:5432").await;
    link.set(Mode::Strand);
    let mut relay = RelayProcess::start(RELAY_BIN, &env(&link));
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(relay.exited().is_none(), "the relay gave up at start-up");
    relay.signal("TERM").await;
    let stopped = tokio::time::timeout(Duration::from_secs(60), relay.wait()).await;
    assert_eq!(
        stopped,
        Ok(Some(0)),
        "stranded at start-up, SIGTERM did not stop the relay within 60 s (hold limit 900 s)"
    );

    // Running: it publishes, then Postgres goes silent under it.
    let link = Proxy::start("127.0.0.1:5432").await;
    let mut relay = RelayProcess::start(RELAY_BIN, &env(&link));
    publishes_one(&db, &rabbit).await;
    link.set(Mode::Strand);
    // Past the sessions' next polls and reconnects.
    tokio::time::sleep(Duration::from_secs(3)).await;
    relay.signal("TERM").await;
    let stopped = tokio::time::timeout(Duration::from_secs(60), relay.wait()).await;
    assert_eq!(
        stopped,
        Ok(Some(0)),
        "with Postgres stranded, SIGTERM did not stop the relay within 60 s (grace 5 s, hold limit 900 s)"
    );
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// SIGTERM while an HTTP client holds a request half sent: a scraper or
/// probe that stalled, a port scanner, a peer gone without a FIN. The
/// endpoints' graceful shutdown closes idle connections and waits for the
/// others, without a timer, and the relay waited for the endpoints: it
/// drained, then never exited, until the orchestrator's SIGKILL (and with
/// a task that had failed, it never exited 1 to be restarted). The relay
/// now gives open HTTP connections a short while, then exits anyway.
#[tokio::test]
async fn sigterm_with_an_http_request_half_sent_still_exits() {
    let _broker = BROKER.lock().await;
    use outbox_tests::process::RelayProcess;
    use tokio::io::AsyncWriteExt;
    const RELAY_BIN: &str = env!("CARGO_BIN_EXE_outbox-relay-under-test");
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let port = outbox_tests::free_port();
    let mut relay = RelayProcess::start(
        RELAY_BIN,
        &[
            ("OUTBOX_SCHEMA", db.schema.to_string()),
            ("OUTBOX_HTTP_ADDR", format!("127.0.0.1:{port}")),
            ("OUTBOX_SHUTDOWN_GRACE", "5s".to_string()),
        ],
    );
    publishes_one(&db, &rabbit).await;
    let mut stalled = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to the endpoints");
    // A whole request first, its answer read: the connection is accepted
    // and served. Then half of the next.
    stalled
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: relay\r\n\r\n")
        .await
        .expect("a request");
    let mut answer = [0u8; 1024];
    let n = tokio::io::AsyncReadExt::read(&mut stalled, &mut answer)
        .await
        .expect("an answer");
    assert!(
        String::from_utf8_lossy(&answer[..n]).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&answer[..n])
    );
    stalled
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: relay\r\n")
        .await
        .expect("half a request");
    // For the server to read the partial head, which it waits for.
    tokio::time::sleep(Duration::from_millis(500)).await;
    relay.signal("TERM").await;
    let stopped = tokio::time::timeout(Duration::from_secs(30), relay.wait()).await;
    drop(stalled);
    assert_eq!(
        stopped,
        Ok(Some(0)),
        "with a request half sent, SIGTERM did not stop the relay within 30 s (grace 5 s)"
    );
    rabbit.cleanup().await;
    db.cleanup().await;
}
