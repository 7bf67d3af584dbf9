//! The inbox check alone: in the caller's transaction, the SQL function for
//! other languages, and retention.

use std::time::Duration;

use outbox_client::inbox::{Arrival, Inbox};
use outbox_tests::db::TestDb;

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
