//! PgBouncer in front of Postgres, as most production deployments have it.
//!
//! - The relay refuses a transaction- or statement-mode pooler at start-up
//!   with one line naming the problem and the fix; before, it half worked:
//!   batches failed with a bare "db error" and partitions stayed owned by
//!   pooled server connections that no relay held.
//! - The app's side works through a transaction pooler: enqueue and
//!   enqueue_batch in the app's transaction, and the inbox, from many clients
//!   at once, delivered end to end by a relay connected directly.
//! - A session-mode pool works fully, relay included.

use std::collections::HashSet;
use std::time::Duration;

use outbox_client::{inbox, Message};
use outbox_tests::amqp::Fixture;
use outbox_tests::db::{connect, TestDb};
use outbox_tests::pgbouncer::PgBouncer;
use outbox_tests::{eventually, fast_settings, InProcessRelay};

const RELAY_BIN: &str = env!("CARGO_BIN_EXE_outbox-relay-under-test");

async fn relay_command(args: &[&str], url: &str, schema: &str) -> (Option<i32>, String) {
    let mut child = tokio::process::Command::new(RELAY_BIN)
        .args(args)
        .env("OUTBOX_DATABASE_URL", url)
        .env("OUTBOX_SCHEMA", schema)
        .env("OUTBOX_AMQP_URL", outbox_tests::amqp_url())
        .env("OUTBOX_HTTP_ADDR", "127.0.0.1:0")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("run relay");
    let mut pipe = child.stderr.take().expect("stderr");
    let stderr = tokio::spawn(async move {
        let mut v = Vec::new();
        let _ = tokio::io::AsyncReadExt::read_to_end(&mut pipe, &mut v).await;
        String::from_utf8_lossy(&v).into_owned()
    });
    let code = match tokio::time::timeout(Duration::from_secs(60), child.wait()).await {
        Ok(status) => status.expect("wait relay").code(),
        Err(_) => {
            // Say what the relay was doing instead of only that it ran on.
            let _ = child.kill().await;
            let log = stderr.await.unwrap_or_default();
            panic!("the relay neither ran nor exited within 60 s; its log:\n{log}");
        }
    };
    (code, stderr.await.unwrap_or_default())
}

#[tokio::test]
async fn the_relay_refuses_a_transaction_or_statement_pooler_with_one_clear_line() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    for mode in ["transaction", "statement"] {
        let bouncer = PgBouncer::start(mode).await;
        let url = bouncer.url("postgres");
        for command in [&["run"][..], &["migrate"][..]] {
            let (code, stderr) = relay_command(command, &url, db.schema.as_str()).await;
            assert_ne!(code, Some(0), "{mode} pooler, {command:?}: {stderr}");
            let lines: Vec<&str> = stderr.lines().filter(|l| l.contains("error")).collect();
            assert_eq!(
                lines.len(),
                1,
                "{mode} pooler, {command:?}: one error line expected:\n{stderr}"
            );
            assert!(
                lines[0].contains("does not keep a session")
                    && lines[0].contains("connect it to Postgres directly")
                    && lines[0].contains("session-mode pool"),
                "{mode} pooler, {command:?}: {stderr}"
            );
        }
    }
    db.cleanup().await;
}

#[tokio::test]
async fn the_app_enqueues_and_dedupes_through_a_transaction_pooler() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let bouncer = PgBouncer::start("transaction").await;
    let pooled: tokio_postgres::Config = bouncer.url("postgres").parse().expect("url");
    let outbox = db.outbox();

    // Many app connections through few server connections, each statement of
    // each transaction possibly on a different one than the last.
    let mut tasks = Vec::new();
    for w in 0..8 {
        let (pooled, outbox, exchange) = (pooled.clone(), outbox.clone(), rabbit.exchange.clone());
        tasks.push(tokio::spawn(async move {
            let mut client = connect(&pooled).await;
            let mut ids = Vec::new();
            for t in 0..40 {
                let tx = client.transaction().await.expect("begin");
                let one = Message::builder(exchange.as_str())
                    .key(format!("w{w}"))
                    .payload(format!("{w}-{t}-a").into_bytes())
                    .build()
                    .expect("valid");
                ids.push(outbox.enqueue(&tx, &one).await.expect("enqueue"));
                let more: Vec<Message> = (0..3)
                    .map(|i| {
                        Message::builder(exchange.as_str())
                            .key(format!("w{w}"))
                            .payload(format!("{w}-{t}-{i}").into_bytes())
                            .build()
                            .expect("valid")
                    })
                    .collect();
                ids.extend(
                    outbox
                        .enqueue_batch(&tx, &more)
                        .await
                        .expect("enqueue_batch"),
                );
                tx.commit().await.expect("commit");
            }
            ids
        }));
    }
    let mut expected = HashSet::new();
    for t in tasks {
        expected.extend(t.await.expect("writer").into_iter().map(|i| i.to_string()));
    }

    // The inbox in the consumer's transaction, through the same pooler.
    let mut client = connect(&pooled).await;
    let inbox = inbox::Inbox::with_schema(db.schema.clone());
    for round in 0..2 {
        let tx = client.transaction().await.expect("begin");
        let outcome = inbox
            .process_once(&tx, "billing", "evt-1")
            .await
            .expect("inbox");
        tx.commit().await.expect("commit");
        assert_eq!(
            outcome == inbox::Arrival::New,
            round == 0,
            "round {round}: {outcome:?}"
        );
    }

    // The cron lock needs a session: through this pooler it refuses clearly
    // instead of taking a lock that would stay on a pooled server connection.
    let ran = outbox_client::job_lock::run_exclusive(&pooled, "nightly", |_| async {}).await;
    assert!(
        matches!(ran, Err(outbox_client::job_lock::JobLockError::NoSession)),
        "job lock through a transaction pooler: {ran:?}"
    );

    // The relay itself connects directly.
    let relay = InProcessRelay::amqp(&db, fast_settings());
    let delivered = || -> HashSet<String> { rabbit.message_ids().into_iter().collect() };
    assert!(
        eventually(Duration::from_secs(60), || async {
            expected.is_subset(&delivered())
        })
        .await,
        "{} of {} delivered",
        expected.intersection(&delivered()).count(),
        expected.len()
    );
    relay.stop().await;
    rabbit.cleanup().await;
    db.cleanup().await;
}

#[tokio::test]
async fn a_session_mode_pool_works_fully() {
    outbox_tests::init_logging();
    let bouncer = PgBouncer::start("session").await;
    let config: tokio_postgres::Config = bouncer.url("postgres").parse().expect("url");
    let schema = outbox_tests::unique("t");
    // Migrate, run and inspect through the pool, as an operator would.
    let (code, stderr) = relay_command(&["migrate"], &bouncer.url("postgres"), &schema).await;
    assert_eq!(code, Some(0), "migrate through a session pool: {stderr}");
    let db = TestDb {
        config: config.clone(),
        schema: outbox_client::SchemaName::new(&schema).expect("schema"),
        client: connect(&config).await,
    };
    let rabbit = Fixture::new().await;
    let msgs: Vec<Message> = (0..300)
        .map(|i| {
            Message::builder(rabbit.exchange.as_str())
                .key(format!("k{}", i % 17))
                .payload(b"x".to_vec())
                .build()
                .expect("valid")
        })
        .collect();
    db.outbox()
        .enqueue_batch(&db.client, &msgs)
        .await
        .expect("enqueue");
    let ran = outbox_client::job_lock::run_exclusive(&config, "nightly", |_| async { 7 }).await;
    assert!(
        matches!(ran, Ok(outbox_client::job_lock::Exclusive::Ran(7))),
        "job lock through a session pool: {ran:?}"
    );
    let relay = InProcessRelay::amqp(&db, fast_settings());
    assert!(
        eventually(Duration::from_secs(60), || async { rabbit.count() >= 300 }).await,
        "{} of 300 delivered through a session pool",
        rabbit.count()
    );
    relay.stop().await;
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// An app that migrates at start-up through the pooler it enqueues
/// through (a transaction pooler such as PgBouncer or Supavisor, from
/// several instances starting at once). Before, `outbox_client::migrate`
/// took a session advisory lock and set `search_path` on whichever server
/// connection ran that statement, and ran each migration on another: the
/// schema's objects went to `public`, the lock stayed held by a pooled
/// server connection (the next start-up waited on it), and the path
/// leaked to other clients of the pool.
#[tokio::test]
async fn the_apps_own_migrate_through_a_transaction_pooler_lands_in_its_schema_and_holds_nothing() {
    outbox_tests::init_logging();
    let admin = TestDb::new().await;
    let db_name = outbox_tests::unique("pooled_migrate");
    admin
        .client
        .batch_execute(&format!("CREATE DATABASE {db_name}"))
        .await
        .expect("create database");
    let bouncer = PgBouncer::start("transaction").await;
    let pooled: tokio_postgres::Config = bouncer.url(&db_name).parse().expect("url");
    let direct: tokio_postgres::Config = format!("postgres://postgres@127.0.0.1:5432/{db_name}")
        .parse()
        .expect("url");
    let schema = outbox_tests::unique("app");

    // Other clients of the pool keep taking server connections between
    // the migrating clients' statements, as a live app's requests do.
    let stop = tokio_util::sync::CancellationToken::new();
    let mut noise = Vec::new();
    for _ in 0..4 {
        let (pooled, stop) = (pooled.clone(), stop.clone());
        noise.push(tokio::spawn(async move {
            let client = connect(&pooled).await;
            while !stop.is_cancelled() {
                let _ = client.simple_query("SELECT pg_sleep(0.002)").await;
            }
        }));
    }
    let mut instances = Vec::new();
    for _ in 0..3 {
        let (pooled, schema) = (pooled.clone(), schema.clone());
        instances.push(tokio::spawn(async move {
            let mut client = connect(&pooled).await;
            tokio::time::timeout(
                Duration::from_secs(60),
                outbox_client::migrate(&mut client, &schema),
            )
            .await
        }));
    }
    let mut outcomes = Vec::new();
    for i in instances {
        outcomes.push(i.await.expect("instance"));
    }
    // Whatever the pooler's server connections still hold.
    let check = connect(&direct).await;
    let held: i64 = check
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            &[],
        )
        .await
        .expect("locks")
        .get(0);
    let misplaced: Vec<String> = check
        .query(
            "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = 'public' \
             UNION ALL SELECT p.proname::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
             WHERE n.nspname = 'public'",
            &[],
        )
        .await
        .expect("public")
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut paths = HashSet::new();
    for _ in 0..8 {
        let c = connect(&pooled).await;
        let rows = c.simple_query("SHOW search_path").await.expect("show");
        for m in rows {
            if let tokio_postgres::SimpleQueryMessage::Row(r) = m {
                paths.insert(r.get(0).unwrap_or_default().to_owned());
            }
        }
    }
    stop.cancel();
    for n in noise {
        let _ = n.await;
    }
    assert!(
        outcomes.iter().all(|o| matches!(o, Ok(Ok(())))),
        "migrations through the pooler: {outcomes:?}"
    );
    assert!(misplaced.is_empty(), "created in public: {misplaced:?}");
    assert_eq!(
        held, 0,
        "advisory locks left held by pooled server connections"
    );
    assert!(
        paths.iter().all(|p| !p.contains(&schema)),
        "search_path left set for other clients of the pool: {paths:?}"
    );
    // The schema is whole: an enqueue through the pooler lands in it.
    let client = connect(&pooled).await;
    let outbox = outbox_client::Outbox::new(&schema).expect("schema");
    outbox
        .enqueue(
            &client,
            &Message::builder("orders")
                .payload(b"x".to_vec())
                .build()
                .expect("valid"),
        )
        .await
        .expect("enqueue into the migrated schema");
    drop((check, client));
    drop(bouncer);
    let _ = admin
        .client
        .batch_execute(&format!("DROP DATABASE {db_name} WITH (FORCE)"))
        .await;
    admin.cleanup().await;
}
