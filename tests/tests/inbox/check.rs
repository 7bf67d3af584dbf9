//! The inbox check alone: in the caller's transaction, the SQL function for
//! other languages, and retention.

use std::time::Duration;

use outbox_client::inbox::{Arrival, Inbox};
use outbox_tests::db::TestDb;
use outbox_tests::random_hex;

/// A message id comes from whoever published the message, and a foreign
/// publisher may put a NUL character in it, which Postgres text cannot
/// store. That came back as a bare "database error" that aborted the
/// consumer's transaction, and with it the effect the transaction held. It
/// is now refused before any SQL, naming the field, and the transaction goes
/// on.
#[tokio::test]
async fn a_nul_in_a_message_id_is_refused_by_name_and_the_transaction_goes_on() {
    let mut db = TestDb::new().await;
    let inbox = Inbox::with_schema(db.schema.clone());
    let tx = db.client.transaction().await.expect("tx");
    for (consumer, id, field) in [("c", "m\0", "message id"), ("c\0", "m", "consumer name")] {
        let err = inbox
            .process_once(&tx, consumer, id)
            .await
            .expect_err("a NUL is refused");
        assert!(err.is_invalid_input(), "{err:?}");
        assert_eq!(err.to_string(), format!("{field} contains a NUL character"));
    }
    assert_eq!(
        inbox.process_once(&tx, "c", "m").await.expect("check"),
        Arrival::New
    );
    tx.commit().await.expect("commit");
    db.cleanup().await;
}

/// The inbox keys a record by (consumer, message id), and a Postgres btree
/// entry holds at most 2,704 bytes of a key that does not compress. A
/// foreign producer's id of 3,000 bytes came back as a bare "database
/// error" that aborted the consumer's transaction. Keys of the inbox (and
/// of checkpoints and send-once notifications) are limited to 512 bytes,
/// refused by name before any SQL; one of 512 bytes is recorded.
#[tokio::test]
async fn an_inbox_key_over_the_limit_is_refused_by_name_and_one_at_it_recorded() {
    let mut db = TestDb::new().await;
    let inbox = Inbox::with_schema(db.schema.clone());
    let tx = db.client.transaction().await.expect("tx");
    for (consumer, id, field, size) in [
        ("c".to_owned(), random_hex(513), "message id", 513),
        ("c".to_owned(), random_hex(3_000), "message id", 3_000),
        (random_hex(600), "m".to_owned(), "consumer name", 600),
    ] {
        let err = inbox
            .process_once(&tx, &consumer, &id)
            .await
            .expect_err("a key over the limit is refused");
        assert!(err.is_invalid_input(), "{err:?}");
        assert_eq!(
            err.to_string(),
            format!("{field} of {size} bytes exceeds the limit of 512 bytes")
        );
    }
    assert_eq!(
        inbox
            .process_once(&tx, &random_hex(512), &random_hex(512))
            .await
            .expect("check"),
        Arrival::New
    );
    tx.commit().await.expect("commit");
    db.cleanup().await;
}

/// Consumers in other languages call `inbox_process_once()`, which holds
/// them to the same 512 bytes: a longer id is refused with SQLSTATE 22023
/// and a message naming its size, like `enqueue()`'s refusals, instead of
/// Postgres's error about an index row; one at the limit is recorded.
#[tokio::test]
async fn the_sql_inbox_check_refuses_a_key_over_the_limit_by_name() {
    let db = TestDb::new().await;
    let f = format!("{}.inbox_process_once", db.schema.quoted());
    let sql = format!("SELECT {f}($1, $2)");
    for (consumer, id, expected) in [
        (
            "c".to_owned(),
            "m".repeat(513),
            "outbox: message id of 513 bytes exceeds the limit of 512 bytes",
        ),
        (
            "c".repeat(600),
            "m".to_owned(),
            "outbox: consumer name of 600 bytes exceeds the limit of 512 bytes",
        ),
    ] {
        let refused = db
            .client
            .query_one(&sql, &[&consumer, &id])
            .await
            .expect_err("a key over the limit is refused");
        let refused = refused.as_db_error().expect("a database error");
        assert_eq!(
            refused.code(),
            &tokio_postgres::error::SqlState::INVALID_PARAMETER_VALUE
        );
        assert_eq!(refused.message(), expected);
    }
    let first: bool = db
        .client
        .query_one(&sql, &[&"c".repeat(512), &"m".repeat(512)])
        .await
        .expect("keys at the limit")
        .get(0);
    assert!(first);
    db.cleanup().await;
}

/// The inbox check alone: first New, then Duplicate, and a rolled-back record
/// leaves the id unseen.
#[tokio::test]
async fn inbox_records_in_the_callers_transaction() {
    let mut db = TestDb::new().await;
    let inbox = Inbox::with_schema(db.schema.clone());

    let tx = db.client.transaction().await.expect("tx");
    assert_eq!(
        inbox.process_once(&tx, "c", "m-1").await.expect("check"),
        Arrival::New
    );
    tx.rollback().await.expect("rollback");

    let tx = db.client.transaction().await.expect("tx");
    assert_eq!(
        inbox.process_once(&tx, "c", "m-1").await.expect("check"),
        Arrival::New,
        "a rolled-back record must not count"
    );
    tx.commit().await.expect("commit");

    let tx = db.client.transaction().await.expect("tx");
    assert_eq!(
        inbox.process_once(&tx, "c", "m-1").await.expect("check"),
        Arrival::Duplicate
    );
    assert_eq!(
        inbox
            .process_once(&tx, "other", "m-1")
            .await
            .expect("check"),
        Arrival::New,
        "consumers are independent"
    );
    tx.commit().await.expect("commit");

    // The SQL function for other languages agrees with the Rust check.
    let f = format!("{}.inbox_process_once", db.schema.quoted());
    let first: bool = db
        .client
        .query_one(&format!("SELECT {f}('sql', 'm-2')"), &[])
        .await
        .expect("function")
        .get(0);
    let again: bool = db
        .client
        .query_one(&format!("SELECT {f}('sql', 'm-2')"), &[])
        .await
        .expect("function")
        .get(0);
    assert!(first && !again);
    let tx = db.client.transaction().await.expect("tx");
    assert_eq!(
        inbox.process_once(&tx, "sql", "m-2").await.expect("check"),
        Arrival::Duplicate
    );
    drop(tx);

    let tx = db.client.transaction().await.expect("tx");
    assert!(inbox.process_once(&tx, "c", "").await.is_err());
    drop(tx);
    db.cleanup().await;
}

/// Retention deletes old entries in batches and keeps recent ones.
#[tokio::test]
async fn inbox_purge_deletes_only_entries_past_the_window() {
    let db = TestDb::new().await;
    let inbox = Inbox::with_schema(db.schema.clone());
    let table = format!("{}.inbox", db.schema.quoted());
    db.client
        .execute(
            &format!(
                "INSERT INTO {table} (consumer, message_id, processed_at) \
                 SELECT 'c', 'old-' || g, now() - interval '30 days' FROM generate_series(1, 2500) g"
            ),
            &[],
        )
        .await
        .expect("seed old");
    db.client
        .execute(
            &format!(
                "INSERT INTO {table} (consumer, message_id) \
                 SELECT 'c', 'new-' || g FROM generate_series(1, 10) g"
            ),
            &[],
        )
        .await
        .expect("seed new");
    let deleted = inbox
        .purge(&db.client, Duration::from_secs(14 * 86_400), 1000)
        .await
        .expect("purge");
    assert_eq!(deleted, 2500);
    let left: Vec<String> = db
        .client
        .query(&format!("SELECT message_id FROM {table}"), &[])
        .await
        .expect("left")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(left.len(), 10);
    assert!(left.iter().all(|m| m.starts_with("new-")));
    db.cleanup().await;
}

/// The SQL inbox check as two consumers meet it when a broker redelivers a
/// message to a second consumer instance while the first is still applying
/// it: the second call waits for the first transaction, then reports a
/// duplicate if it committed and a first arrival if it rolled back. The call
/// works whatever the caller's `search_path` (the function names the inbox
/// with its schema), empty or holding a look-alike `inbox` table first.
#[tokio::test]
async fn the_sql_inbox_check_waits_for_a_concurrent_holder_whatever_the_callers_path() {
    let db = TestDb::new().await;
    let f = format!("{}.inbox_process_once", db.schema.quoted());
    let decoy = db
        .create_decoy("CREATE TABLE {decoy}.inbox (consumer text, message_id text)")
        .await;
    for (path, end) in [(decoy.clone(), "COMMIT"), ("''".to_owned(), "ROLLBACK")] {
        let mut first = outbox_tests::db::connect(&db.config).await;
        let mut second = outbox_tests::db::connect(&db.config).await;
        for c in [&mut first, &mut second] {
            c.batch_execute(&format!("SET search_path = {path}"))
                .await
                .expect("path");
        }
        let id = outbox_tests::unique("m");
        let tx = first.transaction().await.expect("tx");
        let new: bool = tx
            .query_one(&format!("SELECT {f}('billing', $1)"), &[&id])
            .await
            .expect("first call")
            .get(0);
        assert!(new, "path {path}: the first call is a first arrival");
        let racing = {
            let (f, id) = (f.clone(), id.clone());
            tokio::spawn(async move {
                let tx = second.transaction().await.expect("tx");
                let v: bool = tx
                    .query_one(&format!("SELECT {f}('billing', $1)"), &[&id])
                    .await
                    .expect("second call")
                    .get(0);
                tx.commit().await.expect("commit");
                v
            })
        };
        // The second call waits on the first transaction's row: the server
        // shows it blocked by the first session.
        let blocker = tx
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .expect("pid")
            .get::<_, i32>(0);
        let started = std::time::Instant::now();
        loop {
            let waiting: i64 = db
                .client
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity \
                     WHERE $1 = ANY (pg_blocking_pids(pid)) AND query LIKE '%inbox_process_once%'",
                    &[&blocker],
                )
                .await
                .expect("activity")
                .get(0);
            if waiting == 1 {
                break;
            }
            assert!(
                !racing.is_finished(),
                "path {path}: the second call returned without waiting for the first transaction"
            );
            assert!(
                started.elapsed() < crate::PATIENCE,
                "path {path}: the second call never waited"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if end == "COMMIT" {
            tx.commit().await.expect("commit");
        } else {
            tx.rollback().await.expect("rollback");
        }
        let second_new = racing.await.expect("join");
        assert_eq!(
            second_new,
            end == "ROLLBACK",
            "path {path}: after the first transaction's {end}, the second call is {}",
            if end == "ROLLBACK" {
                "a first arrival"
            } else {
                "a duplicate"
            }
        );
    }
    db.drop_empty_decoy(&decoy, "inbox").await;
    db.cleanup().await;
}

/// Under `REPEATABLE READ` (a database or role default), a second consumer
/// whose snapshot predates the first one's commit does not get `Duplicate`
/// but a serialization failure. It came back as a bare database error that
/// callers could not tell from a broken schema; it says now that running
/// the message again may succeed, and run again it is a duplicate.
#[tokio::test]
async fn a_race_under_repeatable_read_is_a_retryable_error_then_a_duplicate() {
    let db = TestDb::new().await;
    let inbox = Inbox::with_schema(db.schema.clone());
    let id = outbox_tests::unique("m");
    let mut first = outbox_tests::db::connect(&db.config).await;
    let mut second = outbox_tests::db::connect(&db.config).await;
    for c in [&first, &second] {
        c.batch_execute("SET default_transaction_isolation = 'repeatable read'")
            .await
            .expect("isolation");
    }
    let a = first.transaction().await.expect("tx");
    assert_eq!(
        inbox.process_once(&a, "billing", &id).await.expect("first"),
        Arrival::New
    );
    let b = second.transaction().await.expect("tx");
    // The second consumer's snapshot is taken before the first commits.
    b.batch_execute("SELECT 1").await.expect("snapshot");
    let (raced, committed) = tokio::join!(inbox.process_once(&b, "billing", &id), async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        a.commit().await
    });
    committed.expect("commit");
    drop(b);
    let err = raced.expect_err("a serialization failure under repeatable read");
    assert!(err.is_retryable(), "{err:?}");
    assert!(!err.is_invalid_input(), "{err:?}");
    let again = second.transaction().await.expect("tx");
    assert_eq!(
        inbox
            .process_once(&again, "billing", &id)
            .await
            .expect("again"),
        Arrival::Duplicate
    );
    again.rollback().await.expect("rollback");
    db.cleanup().await;
}
