//! The operator CLI on dead letters: list, show, locate, discard, status, and
//! the exit codes and messages for bad arguments and unmigrated schemas.

use outbox_tests::amqp;
use outbox_tests::db::TestDb;
use outbox_tests::{eventually, InProcessRelay};
use tokio::process::Command;

use super::{cli, msg, settings, PATIENCE, RELAY_BIN};

#[tokio::test]
async fn cli_lists_shows_discards_and_rejects_bad_arguments() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let side = outbox_tests::unique("side");
    amqp::declare_unbound_exchange(&side).await;
    let relay = InProcessRelay::amqp(&db, settings(true));
    let id = db
        .outbox()
        .enqueue(&db.client, &msg(&side, "k", 7))
        .await
        .expect("enqueue");
    assert!(eventually(PATIENCE, || async { db.count("dead_letters").await == 1 }).await);
    relay.stop().await;

    let (code, out, _) = cli(&db, &["dead-letters", "list", "--json"]).await;
    assert_eq!(code, 0);
    let list: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(list[0]["message_id"], id.to_string());
    assert_eq!(list[0]["destination"], side);
    let (code, out, _) = cli(&db, &["dead-letters", "list", "--key", "k"]).await;
    assert_eq!(code, 0);
    assert!(
        out.contains(&id.to_string()) && out.contains("unroutable"),
        "{out}"
    );
    let (_, out, _) = cli(&db, &["dead-letters", "list", "--key", "other"]).await;
    assert!(out.contains("no dead letters match"), "{out}");
    let (code, out, _) = cli(&db, &["dead-letters", "show", &id.to_string()]).await;
    assert_eq!(code, 0);
    assert!(
        out.contains("payload 1 bytes") && out.contains("attempts=3"),
        "{out}"
    );
    // The payload only when asked for; timestamps absolute as well as ages.
    let (code, out, _) = cli(&db, &["dead-letters", "show", &id.to_string(), "--json"]).await;
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert!(v.get("payload").is_none(), "{v}");
    let dead_at = v["dead_at"].as_str().unwrap_or("");
    assert!(
        dead_at.ends_with('Z') && humantime::parse_rfc3339(dead_at).is_ok(),
        "{v}"
    );
    assert!(
        v["created_at"].as_str().is_some_and(|t| t <= dead_at),
        "{v}"
    );
    let (code, out, _) = cli(
        &db,
        &[
            "dead-letters",
            "show",
            &id.to_string(),
            "--payload",
            "--json",
        ],
    )
    .await;
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["payload"]["encoding"], "utf-8", "{v}");
    assert_eq!(v["payload"]["data"], "7", "the enqueued JSON payload: {v}");
    let (_, out, _) = cli(&db, &["dead-letters", "show", &id.to_string(), "--payload"]).await;
    assert!(out.contains("payload (utf-8): 7"), "{out}");
    let (code, out, _) = cli(&db, &["locate", &id.to_string()]).await;
    assert_eq!(code, 0);
    assert!(out.contains("dead-lettered"), "{out}");

    // A message that is nowhere: reported, and exit code 1 for scripts.
    let nowhere = uuid::Uuid::now_v7().to_string();
    let (code, out, err) = cli(&db, &["locate", &nowhere]).await;
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        out.contains("unknown") && err.contains(&nowhere),
        "{out}{err}"
    );
    // No relay running on a migrated schema: the report, then exit 1.
    let idle = TestDb::new().await;
    let (code, out, err) = cli(&idle, &["status"]).await;
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("replicas (0 of 64 partitions owned)"), "{out}");
    assert!(err.contains("no relay replica is running"), "{err}");
    let (code, out, _) = cli(&idle, &["status", "--json"]).await;
    assert_eq!(code, 1);
    let v: serde_json::Value = serde_json::from_str(&out).expect("the json report still comes");
    assert_eq!(v["replicas"], serde_json::json!([]), "{v}");
    idle.cleanup().await;
    // A schema never migrated: say which command fixes it.
    let never = outbox_tests::unique("never");
    for args in [
        &["status"][..],
        &["dead-letters", "list"][..],
        &["pause", "x"][..],
    ] {
        let out = Command::new(RELAY_BIN)
            .args(args)
            .env("OUTBOX_DATABASE_URL", outbox_tests::pg_url())
            .env("OUTBOX_SCHEMA", &never)
            .stdin(std::process::Stdio::null())
            .output()
            .await
            .expect("run cli");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("is not migrated; run `outbox-relay migrate` first"),
            "{args:?}: {err}"
        );
    }

    // Bad arguments: exit code 2 with a clear message.
    let (code, _, err) = cli(&db, &["dead-letters", "discard", "--yes"]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--all"), "{err}");
    let (code, _, err) = cli(&db, &["locate", "not-a-uuid"]).await;
    assert_eq!(code, 2);
    assert!(err.contains("<ID>"), "{err}");
    let (code, _, err) = cli(&db, &["dead-letters", "list", "--since", "yesterday"]).await;
    assert_eq!(code, 2);
    assert!(err.contains("--since"), "{err}");
    // Without a terminal and without --yes, a destructive command refuses.
    let (code, _, err) = cli(&db, &["dead-letters", "discard", "--all"]).await;
    assert_eq!(code, 1);
    assert!(err.contains("--yes"), "{err}");
    assert_eq!(db.count("dead_letters").await, 1);

    let (code, out, _) = cli(
        &db,
        &[
            "dead-letters",
            "discard",
            "--id",
            &id.to_string(),
            "--yes",
            "--json",
        ],
    )
    .await;
    assert_eq!(code, 0);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&out).expect("json")["discarded"],
        1
    );
    let (_, out, _) = cli(&db, &["locate", &id.to_string(), "--json"]).await;
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&out).expect("json")["state"],
        "unknown"
    );
    amqp::delete_exchange(&side).await;
    db.cleanup().await;
}

/// `locate` of a message still waiting for its first claim, and the dead
/// letters of a backfill that kept its events' own times (before 1970).
/// Before, both panicked in the time formatting: a fresh row's
/// `next_attempt_at` is `'-infinity'`, and the formatter took nothing
/// before 1970, so `locate` failed for every message not yet sent.
#[tokio::test]
async fn locate_and_list_answer_for_fresh_rows_and_times_before_1970() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let id = db
        .outbox()
        .enqueue(&db.client, &msg("orders", "k", 1))
        .await
        .expect("enqueue");
    let (code, out, err) = cli(&db, &["locate", &id.to_string(), "--json"]).await;
    assert_eq!(code, 0, "locate of a fresh row: {err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["state"], "pending", "{v}");
    assert_eq!(v["next_attempt_at"], "-infinity", "{v}");
    let (code, out, err) = cli(&db, &["locate", &id.to_string()]).await;
    assert_eq!(code, 0, "{err}");
    assert!(!out.is_empty());

    let s = db.schema.quoted();
    db.client
        .batch_execute(&format!(
            "INSERT INTO {s}.dead_letters (seq, message_id, destination, ordering_key, routing_key, \
                headers, payload, created_at, attempts, last_error, dead_at) \
             VALUES (1000, gen_random_uuid(), 'orders', 'old', '', '{{}}', 'x', \
                '1969-07-20 20:17:40.5+00', 3, 'unroutable', now())"
        ))
        .await
        .expect("a dead letter from a backfill");
    let (code, out, err) = cli(&db, &["dead-letters", "list", "--json"]).await;
    assert_eq!(code, 0, "dead-letters list: {err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v[0]["created_at"], "1969-07-20T20:17:40.500000Z", "{v}");
    let (code, _, err) = cli(&db, &["dead-letters", "list", "--key", "old"]).await;
    assert_eq!(code, 0, "{err}");
    db.cleanup().await;
}

/// `status` names as `long_transaction` only what holds the horizon back
/// and is an operator's to end. It also named a plain VACUUM, which holds
/// no one back, and a relay's own batch waiting on a slow broker, which the
/// runbook then said to end: that sends the whole batch again.
#[tokio::test]
async fn status_names_long_transactions_but_not_vacuum_or_a_relays_own_batch() {
    let db = TestDb::new().await;
    let s = db.schema.quoted();
    db.client
        .batch_execute(&format!(
            "CREATE TABLE {s}.churn AS SELECT g, repeat('x', 100) AS pad FROM generate_series(1, 100000) g; \
             DELETE FROM {s}.churn WHERE g % 2 = 0"
        ))
        .await
        .expect("a table to vacuum");
    let session = |name: &'static str| {
        let mut config = db.config.clone();
        config.application_name(name);
        async move { outbox_tests::db::connect(&config).await }
    };
    // A report left open by an app: the one to name.
    let app = session("reports").await;
    app.batch_execute("BEGIN; SELECT 1").await.expect("open");
    // A relay's batch waiting on its broker.
    let relay = session("outbox-relay").await;
    relay.batch_execute("BEGIN; SELECT 1").await.expect("open");
    // A throttled plain VACUUM, still running when status reads.
    let vacuum = session("maintenance").await;
    vacuum
        .batch_execute("SET vacuum_cost_delay = '100ms'; SET vacuum_cost_limit = 1")
        .await
        .expect("throttle");
    let (app_pid, relay_pid, vacuum_pid) = (
        backend_pid(&app).await,
        backend_pid(&relay).await,
        backend_pid(&vacuum).await,
    );
    let running = tokio::spawn(async move {
        let _ = vacuum.batch_execute(&format!("VACUUM {s}.churn")).await;
    });
    tokio::time::sleep(std::time::Duration::from_secs(12)).await;
    let vacuuming: bool = db
        .client
        .query_one(
            "SELECT count(*) = 1 FROM pg_stat_activity WHERE pid = $1 AND query ILIKE 'VACUUM%'",
            &[&vacuum_pid],
        )
        .await
        .expect("pg_stat_activity")
        .get(0);
    assert!(vacuuming, "the VACUUM ended before status could see it");
    let (_, out, err) = cli(&db, &["status", "--json"]).await;
    let v: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}{err}"));
    let named: Vec<i64> = v["blockers"]
        .as_array()
        .expect("blockers")
        .iter()
        .filter(|b| b["kind"] == "long_transaction")
        .filter_map(|b| b["pid"].as_i64())
        .collect();
    let _ = db
        .client
        .execute("SELECT pg_cancel_backend($1)", &[&vacuum_pid])
        .await;
    let _ = running.await;
    drop((app, relay));
    assert!(
        named.contains(&i64::from(app_pid)),
        "the app's open transaction is not named: {v}"
    );
    assert!(
        !named.contains(&i64::from(vacuum_pid)),
        "a plain VACUUM is named as a long transaction: {v}"
    );
    assert!(
        !named.contains(&i64::from(relay_pid)),
        "a relay's own batch is named as a long transaction: {v}"
    );
    db.cleanup().await;
}

async fn backend_pid(client: &tokio_postgres::Client) -> i32 {
    client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0)
}

/// A key with two dead letters, whose message ids do not follow their seqs
/// (app-chosen ids, or SQL `enqueue()` within one millisecond), and a later
/// message waiting. Under `park`, `status` names the dead letter the claim
/// and `locate` wait behind, the lowest seq; it named the lowest message id.
/// Under `skip` no key is parked: `status` and `locate` said parked all the
/// same, and the runbook then blamed the dead letter.
#[tokio::test]
async fn parked_keys_name_the_first_dead_letter_and_only_under_park() {
    let db = TestDb::new().await;
    let (first, second) = (
        "ffffffff-0000-7000-8000-000000000000",
        "00000000-0000-7000-8000-000000000000",
    );
    for (seq, id) in [(-2_i64, first), (-1, second)] {
        db.client
            .execute(
                &format!(
                    "INSERT INTO {}.dead_letters (seq, message_id, destination, ordering_key, \
                     routing_key, headers, payload, created_at, attempts, last_error) \
                     VALUES ($1, $2::text::uuid, 'orders', 'k', '', '{{}}', 'x', now(), 3, 'unroutable')",
                    db.schema.quoted()
                ),
                &[&seq, &id],
            )
            .await
            .expect("dead letter");
    }
    let waiting = db
        .outbox()
        .enqueue(&db.client, &msg("orders", "k", 1))
        .await
        .expect("enqueue")
        .to_string();

    let (_, out, err) = cli(&db, &["status", "--json"]).await;
    let v: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}{err}"));
    assert_eq!(v["parked_keys"][0]["key"], "k", "{v}");
    assert_eq!(
        v["parked_keys"][0]["behind_dead_letter"], first,
        "the dead letter the key waits behind: {v}"
    );
    let (code, out, err) = cli(&db, &["locate", &waiting, "--json"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["state"], "parked", "{v}");
    assert_eq!(v["behind_dead_letter"], first, "{v}");

    let skip = ["--dead-letter-order", "skip"];
    let (_, out, err) = cli(&db, &[&["status", "--json"][..], &skip].concat()).await;
    let v: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}{err}"));
    assert_eq!(v["parked_keys"], serde_json::json!([]), "{v}");
    let (code, out, err) = cli(&db, &[&["locate", &waiting, "--json"][..], &skip].concat()).await;
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["state"], "pending", "{v}");
    db.cleanup().await;
}

/// A dead letter `id` of key `k` to `orders`, as the relay leaves one.
async fn dead_letter_of_k(db: &TestDb, id: &str) {
    db.client
        .execute(
            &format!(
                "INSERT INTO {}.dead_letters (seq, message_id, destination, ordering_key, \
                 routing_key, headers, payload, created_at, attempts, last_error) \
                 VALUES (-1, $1::text::uuid, 'orders', 'k', '', '{{}}', 'x', now(), 3, 'unroutable')",
                db.schema.quoted()
            ),
            &[&id],
        )
        .await
        .expect("dead letter");
}

/// A later message of a parked key that had failed before (attempts > 0)
/// and was set aside a recheck later: `discard` (like `retry`) brought back
/// only rows that had never failed, so this one, and its key behind it,
/// waited out the recheck (`--retry-max`, a minute by default).
#[tokio::test]
async fn discarding_a_dead_letter_brings_back_its_keys_rows_that_had_failed_before() {
    let db = TestDb::new().await;
    let dead = "01900000-0000-7000-8000-000000000001";
    dead_letter_of_k(&db, dead).await;
    let later = db
        .outbox()
        .enqueue(&db.client, &msg("orders", "k", 1))
        .await
        .expect("enqueue");
    // As a claim leaves it: failed twice, then set aside behind the dead
    // letter until the next recheck.
    db.client
        .execute(
            &format!(
                "UPDATE {} SET attempts = 2, last_error = 'nacked', \
                 next_attempt_at = now() + interval '60 seconds' WHERE message_id = $1",
                db.table()
            ),
            &[&later.as_uuid()],
        )
        .await
        .expect("set aside");
    let (code, out, err) = cli(&db, &["dead-letters", "discard", "--id", dead, "--yes"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let due: bool = db
        .client
        .query_one(
            &format!(
                "SELECT next_attempt_at <= now() FROM {} WHERE message_id = $1",
                db.table()
            ),
            &[&later.as_uuid()],
        )
        .await
        .expect("row")
        .get(0);
    assert!(
        due,
        "the key's row still waits for its recheck after the discard"
    );
    db.cleanup().await;
}

/// Runs the relay's command `args` while a claim holds key `k`'s fresh rows,
/// their hold for a recheck a minute away written and not committed (as a
/// claim does it, in one transaction); checks that the command waits for
/// the claim, then commits the claim and returns what the command said.
async fn while_a_claim_sets_k_aside(db: &TestDb, args: &[&str]) -> (Option<i32>, String, String) {
    let table = db.table();
    let (claim, connection) =
        tokio_postgres::connect(&outbox_tests::pg_url(), tokio_postgres::NoTls)
            .await
            .expect("connect");
    tokio::spawn(connection);
    claim
        .batch_execute(&format!(
            "BEGIN; \
             SELECT seq FROM {table} WHERE ordering_key = 'k' \
               AND next_attempt_at = '-infinity' FOR UPDATE SKIP LOCKED; \
             UPDATE {table} SET next_attempt_at = now() + interval '60 seconds' \
               WHERE ordering_key = 'k'"
        ))
        .await
        .expect("the claim's hold");
    let pid: i32 = claim
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0);
    let command = tokio::spawn({
        let schema = db.schema.to_string();
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            outbox_tests::process::cli(RELAY_BIN, &schema, &args).await
        }
    });
    // Until the command waits on the claim's session: with the rows left
    // unlocked it would not wait at all (a sleep here let a slow start run
    // the command after the commit, and pass on the old code).
    let waits = eventually(PATIENCE, || async {
        db.client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                &[&pid],
            )
            .await
            .expect("blocked sessions")
            .get::<_, i64>(0)
            > 0
    })
    .await;
    assert!(
        waits,
        "{args:?} never waited for the claim setting the key's rows aside"
    );
    claim
        .batch_execute("COMMIT")
        .await
        .expect("the claim commits");
    command.await.expect("the command")
}

/// `discard` while a claim is setting the key's rows aside: the claim has
/// locked the key's fresh rows, found the dead letter and written their
/// hold, and not yet committed. The discard chose the rows to bring back by
/// its own snapshot, where they were fresh, so it neither took nor waited
/// for them; the claim then committed its hold, and the rows waited out
/// `--retry-max` behind a dead letter that no longer existed. The discard
/// now waits for the claim and reads the rows as it left them; `resume`
/// too, for a claim setting rows aside behind a pause.
#[tokio::test]
async fn discard_and_resume_wait_for_a_claim_setting_the_keys_rows_aside() {
    let db = TestDb::new().await;
    let dead = "01900000-0000-7000-8000-000000000002";
    dead_letter_of_k(&db, dead).await;
    for i in 0..5 {
        db.outbox()
            .enqueue(&db.client, &msg("orders", "k", i))
            .await
            .expect("enqueue");
    }
    // Due now, as after the discard; false while any waits for a recheck.
    let all_due = || async {
        db.client
            .query_one(
                &format!(
                    "SELECT bool_and(next_attempt_at <= now()) FROM {} WHERE ordering_key = 'k'",
                    db.table()
                ),
                &[],
            )
            .await
            .expect("rows")
            .get::<_, bool>(0)
    };
    let (code, out, err) =
        while_a_claim_sets_k_aside(&db, &["dead-letters", "discard", "--id", dead, "--yes"]).await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        all_due().await,
        "the key's rows wait for their recheck behind a dead letter that was discarded"
    );

    // The same with `resume` and a claim that found the destination paused.
    let (code, out, err) = cli(&db, &["pause", "orders"]).await;
    assert_eq!(code, 0, "{out}{err}");
    db.client
        .execute(
            &format!("UPDATE {} SET next_attempt_at = '-infinity'", db.table()),
            &[],
        )
        .await
        .expect("fresh again");
    let (code, out, err) = while_a_claim_sets_k_aside(&db, &["resume", "orders"]).await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        all_due().await,
        "the destination's rows wait for their recheck after it was resumed"
    );
    db.cleanup().await;
}

/// The deploy files give the URLs as files (`OUTBOX_DATABASE_URL_FILE`),
/// and an operator who runs a command in the relay's container with
/// `--database-url` pointed elsewhere (staging, a replica) means that
/// database. The file won without a word, so `dead-letters discard` acted
/// on the one the file names. A URL given twice, by value and by file, is
/// now refused with both named, as the official images refuse `X` beside
/// `X_FILE`; for AMQP too.
#[tokio::test]
async fn a_url_given_both_by_value_and_by_file_is_refused() {
    let db = TestDb::new().await;
    let dir = std::env::temp_dir().join(outbox_tests::unique("secrets"));
    std::fs::create_dir_all(&dir).expect("secrets dir");
    let file = dir.join("database_url");
    std::fs::write(&file, outbox_tests::pg_url()).expect("write the secret");
    let elsewhere = "postgres://postgres@127.0.0.1:5432/test";
    let out = Command::new(RELAY_BIN)
        .args(["dead-letters", "list", "--database-url", elsewhere])
        .env_remove("OUTBOX_DATABASE_URL")
        .env("OUTBOX_DATABASE_URL_FILE", &file)
        .env("OUTBOX_SCHEMA", db.schema.as_str())
        .output()
        .await
        .expect("run dead-letters list");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a --database-url beside OUTBOX_DATABASE_URL_FILE was not refused: {err}"
    );
    assert!(
        err.contains("--database-url") && err.contains("--database-url-file"),
        "the refusal does not name both: {err}"
    );
    // Both from the environment.
    let out = Command::new(RELAY_BIN)
        .args(["dead-letters", "list"])
        .env("OUTBOX_DATABASE_URL", elsewhere)
        .env("OUTBOX_DATABASE_URL_FILE", &file)
        .env("OUTBOX_SCHEMA", db.schema.as_str())
        .output()
        .await
        .expect("run dead-letters list");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let amqp_file = dir.join("amqp_url");
    std::fs::write(&amqp_file, outbox_tests::amqp_url()).expect("write the secret");
    let out = Command::new(RELAY_BIN)
        .args(["run", "--amqp-url", "amqp://guest:guest@127.0.0.1:5672/%2f"])
        .env("OUTBOX_DATABASE_URL", outbox_tests::pg_url())
        .env("OUTBOX_AMQP_URL_FILE", &amqp_file)
        .env("OUTBOX_SCHEMA", db.schema.as_str())
        .env("OUTBOX_HTTP_ADDR", "off")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(PATIENCE, out)
        .await
        .expect("the relay ran instead of refusing")
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--amqp-url-file"), "{err}");
    // The file alone still works.
    let out = Command::new(RELAY_BIN)
        .args(["dead-letters", "list"])
        .env_remove("OUTBOX_DATABASE_URL")
        .env("OUTBOX_DATABASE_URL_FILE", &file)
        .env("OUTBOX_SCHEMA", db.schema.as_str())
        .output()
        .await
        .expect("run dead-letters list");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
    db.cleanup().await;
}

/// A misspelled setting (`OUTBOX_SHUTDOWN_GRACE_PERIOD` for
/// `OUTBOX_SHUTDOWN_GRACE`) was ignored without a word and its default
/// applied; every command now names it, with the setting it likely meant.
#[tokio::test]
async fn a_misspelled_variable_is_named_with_the_setting_it_likely_meant() {
    let db = TestDb::new().await;
    let out = Command::new(RELAY_BIN)
        .args(["dead-letters", "list"])
        .env("OUTBOX_DATABASE_URL", outbox_tests::pg_url())
        .env("OUTBOX_SCHEMA", db.schema.as_str())
        .env("OUTBOX_SHUTDOWN_GRACE_PERIOD", "30s")
        .output()
        .await
        .expect("run dead-letters list");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("OUTBOX_SHUTDOWN_GRACE_PERIOD")
            && err.contains("did you mean OUTBOX_SHUTDOWN_GRACE?"),
        "the misspelled variable was not named: {err}"
    );
    db.cleanup().await;
}
