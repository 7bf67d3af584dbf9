//! deploy/roles.sql: the relay works as its restricted role, and the app role
//! can add messages but not read or delete them.

use std::time::Duration;

use outbox_client::Message;
use outbox_tests::amqp::Fixture;
use outbox_tests::db::TestDb;
use outbox_tests::{eventually, fast_settings, InProcessRelay};

/// A login role of the test's own in `group` (one of roles.sql's), and a
/// connection config for it.
async fn login_in(db: &TestDb, group: &str) -> (String, tokio_postgres::Config) {
    let role = outbox_tests::unique(group);
    db.client
        .batch_execute(&format!("CREATE ROLE {role} LOGIN IN ROLE {group}"))
        .await
        .expect("login role");
    let mut config = db.config.clone();
    config.user(&role);
    (role, config)
}

/// roles.sql applied to `db`'s schema, and a login of the relay's role:
/// its name, and `db` as that login sees it.
async fn as_relay_role(db: &TestDb) -> (String, TestDb) {
    outbox_tests::db::apply_roles_sql(&outbox_tests::pg_url(), &db.schema).await;
    let (relay_user, config) = login_in(db, "outbox_relay").await;
    let relay_db = TestDb {
        config,
        schema: db.schema.clone(),
        client: outbox_tests::db::connect(&db.config).await,
    };
    (relay_user, relay_db)
}

#[tokio::test]
async fn relay_runs_as_its_role_and_the_app_role_can_only_insert() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    outbox_tests::db::apply_roles_sql(&outbox_tests::pg_url(), &db.schema).await;
    // Login roles of the test's own, members of the script's roles.
    let (app, relay_user) = (outbox_tests::unique("app"), outbox_tests::unique("relay"));
    db.client
        .batch_execute(&format!(
            "CREATE ROLE {app} LOGIN IN ROLE outbox_app; CREATE ROLE {relay_user} LOGIN IN ROLE outbox_relay;"
        ))
        .await
        .expect("login roles");

    let as_role = |role: &str| {
        let mut c = db.config.clone();
        c.user(role);
        c
    };
    let mut app_client = outbox_tests::db::connect(&as_role(&app)).await;
    // The app's start-up migrate(), with nothing pending: nothing to
    // create, so the app role may run it (it may not create anything).
    outbox_client::migrate(&mut app_client, db.schema.as_str())
        .await
        .expect("the app role's migrate() on a current schema");
    let outbox = db.outbox();
    let msgs: Vec<Message> = outbox_tests::workload::json_over_keys(&rabbit.exchange, 100, 5);
    outbox
        .enqueue_batch(&app_client, &msgs)
        .await
        .expect("the app role can enqueue");
    for forbidden in [
        format!("SELECT count(*) FROM {}", db.table()),
        format!("DELETE FROM {}", db.table()),
        format!("UPDATE {} SET attempts = 0", db.table()),
    ] {
        let err = app_client
            .execute(forbidden.as_str(), &[])
            .await
            .expect_err("must be refused");
        assert_eq!(
            err.code(),
            Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE),
            "{forbidden}"
        );
    }

    let relay_db = TestDb {
        config: as_role(&relay_user),
        schema: db.schema.clone(),
        client: outbox_tests::db::connect(&db.config).await,
    };
    let relay = InProcessRelay::amqp(&relay_db, fast_settings());
    assert!(
        eventually(Duration::from_secs(120), || async { rabbit.count() >= 100 }).await,
        "the relay role could not deliver: {} of 100",
        rabbit.count()
    );
    assert!(
        eventually(Duration::from_secs(60), || async {
            db.pending().await == 0
        })
        .await
    );
    // The claim floor reads the seq sequence; without roles.sql's grant it
    // stays off (at 0) and claims walk rows deleted under old snapshots.
    assert!(
        eventually(Duration::from_secs(60), || async { relay.floor.get() > 0 }).await,
        "the claim floor never moved as the relay's role"
    );
    relay.stop().await;

    // `status` run as the relay's role names another user's long
    // transaction (pg_read_all_stats lets it see xact_start).
    app_client
        .batch_execute("BEGIN; SELECT 1")
        .await
        .expect("open transaction");
    let app_pid: i32 = app_client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0);
    tokio::time::sleep(Duration::from_secs(11)).await;
    let relay_url = outbox_tests::pg_url().replacen("postgres@", &format!("{relay_user}@"), 1);
    assert!(relay_url.contains(&relay_user), "{relay_url}");
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay-under-test"))
        .args(["status", "--json"])
        .env("OUTBOX_DATABASE_URL", &relay_url)
        .env("OUTBOX_SCHEMA", db.schema.as_str())
        .output()
        .await
        .expect("status");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status JSON");
    let seen = v["blockers"].as_array().is_some_and(|b| {
        b.iter()
            .any(|b| b["kind"] == "long_transaction" && b["pid"] == app_pid)
    });
    assert!(
        seen,
        "status as the relay role misses the app's long transaction: {v}"
    );
    drop(app_client);
    rabbit.cleanup().await;
    let _ = db
        .client
        .batch_execute(&format!(
            "DROP SCHEMA {} CASCADE; DROP ROLE {app}; DROP ROLE {relay_user};",
            db.schema.quoted()
        ))
        .await;
}

/// Retention mode as roles.sql's relay role: each row moves to `published`
/// once, also when the sequence was set back under rows kept there. The
/// retain statement once replaced a kept row by `ON CONFLICT DO UPDATE`,
/// which Postgres checks against UPDATE rights (which the role lacks)
/// at every call: every settle failed, rolled back, and its batch went out
/// again at every claim.
#[tokio::test]
async fn retention_as_the_relay_role_settles_each_row_once() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let (relay_user, relay_db) = as_relay_role(&db).await;
    let settings = outbox_relay::Settings {
        retention: Some(Duration::from_secs(3600)),
        ..fast_settings()
    };
    let relay = InProcessRelay::amqp(&relay_db, settings);
    let outbox = db.outbox();
    let published = format!("{}.published", db.schema.quoted());
    for round in 1..=2usize {
        if round == 2 {
            // The seqs start over under the 100 rows kept in `published`
            // (a restart, which the claim floor sees at once; after a bare
            // `setval` rows below the floor wait for its rescan).
            db.client
                .batch_execute(&format!("TRUNCATE {} RESTART IDENTITY", db.table()))
                .await
                .expect("set the sequence back");
        }
        let msgs: Vec<Message> = outbox_tests::workload::json_over_keys(&rabbit.exchange, 100, 5);
        outbox
            .enqueue_batch(&db.client, &msgs)
            .await
            .expect("enqueue");
        assert!(
            eventually(Duration::from_secs(60), || async {
                db.pending().await == 0
            })
            .await,
            "round {round}: {} rows never settled as the relay's role",
            db.pending().await
        );
        let kept: i64 = db
            .client
            .query_one(
                format!("SELECT count(*) FROM {published} WHERE seq <= 100").as_str(),
                &[],
            )
            .await
            .expect("kept rows")
            .get(0);
        assert_eq!(kept, 100, "round {round}");
    }
    // Each message once: no settle rolled back.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let ids = rabbit.message_ids();
    let distinct: std::collections::HashSet<&String> = ids.iter().collect();
    assert_eq!(distinct.len(), 200);
    assert_eq!(
        ids.len(),
        200,
        "{} copies beyond the first",
        ids.len() - 200
    );
    relay.stop().await;
    rabbit.cleanup().await;
    let _ = db
        .client
        .batch_execute(&format!(
            "DROP SCHEMA {} CASCADE; DROP ROLE {relay_user};",
            db.schema.quoted()
        ))
        .await;
}

/// Retention's cleanup as roles.sql's relay role: rows kept past the
/// retention are deleted. The cleanup picked its rows `FOR UPDATE SKIP
/// LOCKED`, which Postgres allows only with UPDATE rights, and the role
/// has none on `published`: every pass failed, quietly retried, and the
/// table grew for good.
#[tokio::test]
async fn retention_cleanup_as_the_relay_role_deletes_what_expired() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let (relay_user, relay_db) = as_relay_role(&db).await;
    let settings = outbox_relay::Settings {
        retention: Some(Duration::from_secs(2)),
        ..fast_settings()
    };
    let relay = InProcessRelay::amqp(&relay_db, settings);
    let msgs: Vec<Message> = outbox_tests::workload::json_over_keys(&rabbit.exchange, 50, 5);
    db.outbox()
        .enqueue_batch(&db.client, &msgs)
        .await
        .expect("enqueue");
    assert!(
        eventually(Duration::from_secs(60), || async {
            db.pending().await == 0
        })
        .await,
        "the relay's role never settled the rows"
    );
    assert!(
        eventually(Duration::from_secs(60), || async {
            db.count("published").await == 0
        })
        .await,
        "{} published rows past a 2 s retention were never deleted as the relay's role",
        db.count("published").await
    );
    relay.stop().await;
    rabbit.cleanup().await;
    let _ = db
        .client
        .batch_execute(&format!(
            "DROP SCHEMA {} CASCADE; DROP ROLE {relay_user};",
            db.schema.quoted()
        ))
        .await;
}

/// The runbook's remedy for dead letters, `dead-letters retry` and
/// `discard`, run as roles.sql's operator role: the relay's role has
/// neither INSERT on the outbox nor DELETE on the dead letters, and no
/// role of the script had both.
#[tokio::test]
async fn the_operator_role_can_retry_and_discard_dead_letters() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    outbox_tests::db::apply_roles_sql(&outbox_tests::pg_url(), &db.schema).await;
    let (operator, _) = login_in(&db, "outbox_operator").await;
    let msgs: Vec<Message> = outbox_tests::workload::json_over_keys("orders", 4, 2);
    let ids = db
        .outbox()
        .enqueue_batch(&db.client, &msgs)
        .await
        .expect("enqueue");
    let s = db.schema.quoted();
    db.client
        .batch_execute(&format!(
            "WITH m AS (DELETE FROM {s}.messages RETURNING *) \
             INSERT INTO {s}.dead_letters (seq, message_id, destination, ordering_key, routing_key, \
                 headers, payload, content_type, created_at, attempts, last_error, event_type) \
             SELECT seq, message_id, destination, ordering_key, routing_key, headers, payload, \
                 content_type, created_at, 10, 'refused', event_type FROM m"
        ))
        .await
        .expect("four dead letters");
    let url = outbox_tests::pg_url().replacen("postgres@", &format!("{operator}@"), 1);
    let run = |args: Vec<String>| {
        let (url, schema) = (url.clone(), db.schema.to_string());
        async move {
            let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay-under-test"))
                .args(&args)
                .env("OUTBOX_DATABASE_URL", url)
                .env("OUTBOX_SCHEMA", schema)
                .output()
                .await
                .expect("outbox-relay");
            assert!(
                out.status.success(),
                "{args:?} as the operator role: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    };
    let argv = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let first = ids[0].to_string();
    run(argv(&["dead-letters", "discard", "--id", &first, "--yes"])).await;
    run(argv(&["dead-letters", "retry", "--all", "--yes"])).await;
    assert_eq!(db.pending().await, 3, "three retried, one discarded");
    let left: i64 = db
        .client
        .query_one(
            format!("SELECT count(*) FROM {s}.dead_letters").as_str(),
            &[],
        )
        .await
        .expect("count")
        .get(0);
    assert_eq!(left, 0);
    let _ = db
        .client
        .batch_execute(&format!("DROP SCHEMA {s} CASCADE; DROP ROLE {operator};"))
        .await;
}
