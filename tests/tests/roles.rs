//! deploy/roles.sql: the relay works as its restricted role, and the app role
//! can add messages but not read or delete them.

use std::time::Duration;

use outbox_client::Message;
use outbox_tests::amqp::Fixture;
use outbox_tests::db::TestDb;
use outbox_tests::{eventually, fast_settings, InProcessRelay};

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
    let app_client = outbox_tests::db::connect(&as_role(&app)).await;
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
