//! An operator's `discard`, `retry` or `resume` racing a claim that sets a
//! key's rows aside.
//!
//! Every recheck (`--retry-max`), a parked key's rows and a paused
//! destination's rows come due; a claim locks them, finds them still held
//! back (its snapshot sees the dead letter, or the pause) and sets them
//! aside again until the next recheck. An operator command that commits
//! while that claim holds the rows must still bring them back at once, as
//! README promises, not a recheck later. Each test plays the claim on a
//! connection of its own, so the moment is not left to chance.

use std::time::Duration;

use outbox_client::Message;
use outbox_relay::ops::{self, Filter};
use outbox_tests::db::{connect, TestDb};
use tokio_postgres::Client;

/// A claim's transaction that has locked the row `seq`, which had come due.
async fn claim_locking(db: &TestDb, seq: i64) -> Client {
    let claim = connect(&db.config).await;
    claim.batch_execute("BEGIN").await.expect("begin");
    let locked = claim
        .execute(
            &format!("SELECT 1 FROM {} WHERE seq = $1 FOR UPDATE", db.table()),
            &[&seq],
        )
        .await
        .expect("lock");
    assert_eq!(locked, 1, "the row to lock is there");
    claim
}

/// The claim sets the row aside until the next recheck, and commits.
async fn claim_sets_aside(db: &TestDb, claim: &Client, seq: i64) {
    claim
        .execute(
            &format!(
                "UPDATE {} SET next_attempt_at = now() + interval '60 seconds' WHERE seq = $1",
                db.table()
            ),
            &[&seq],
        )
        .await
        .expect("set aside");
    claim.batch_execute("COMMIT").await.expect("commit");
}

/// Waits until `command` has finished, or is waiting for a row lock
/// (its statement names this test's schema).
async fn finished_or_waiting<T>(db: &TestDb, command: &tokio::task::JoinHandle<T>) {
    let pattern = format!("%{}%", db.schema.as_str());
    for _ in 0..500 {
        if command.is_finished() {
            return;
        }
        let waiting: i64 = db
            .client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE wait_event_type = 'Lock' AND query LIKE $1 AND pid <> pg_backend_pid()",
                &[&pattern],
            )
            .await
            .expect("pg_stat_activity")
            .get(0);
        if waiting > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the command neither finished nor waited for the claim's lock within 5 s");
}

/// Whether row `seq` is due now (not set aside for later).
async fn due_now(db: &TestDb, seq: i64) -> bool {
    db.client
        .query_one(
            &format!(
                "SELECT next_attempt_at <= now() FROM {} WHERE seq = $1",
                db.table()
            ),
            &[&seq],
        )
        .await
        .expect("the row is still in the outbox")
        .get(0)
}

async fn seq_of(db: &TestDb, id: &outbox_client::MessageId) -> i64 {
    db.client
        .query_one(
            &format!("SELECT seq FROM {} WHERE message_id::text = $1", db.table()),
            &[&id.to_string()],
        )
        .await
        .expect("seq")
        .get(0)
}

/// Key `k`: its head in the dead letters, a later message parked behind it
/// whose recheck has come (due now, not fresh). Returns the later row's seq.
async fn parked_key(db: &TestDb) -> i64 {
    let outbox = db.outbox();
    let msg = |n: i32| {
        Message::builder("d")
            .key("k")
            .json(&n)
            .build()
            .expect("valid")
    };
    let head = outbox.enqueue(&db.client, &msg(0)).await.expect("enqueue");
    let later = outbox.enqueue(&db.client, &msg(1)).await.expect("enqueue");
    let (head, later) = (seq_of(db, &head).await, seq_of(db, &later).await);
    let (t, s) = (db.table(), db.schema.quoted());
    db.client
        .execute(
            &format!(
                "WITH moved AS (DELETE FROM {t} WHERE seq = $1 RETURNING *) \
                 INSERT INTO {s}.dead_letters (seq, message_id, destination, ordering_key, \
                     routing_key, headers, payload, content_type, created_at, attempts, last_error) \
                 SELECT seq, message_id, destination, ordering_key, routing_key, headers, payload, \
                        content_type, created_at, 3, 'refused' FROM moved"
            ),
            &[&head],
        )
        .await
        .expect("dead-letter the head");
    db.client
        .execute(
            &format!("UPDATE {t} SET next_attempt_at = now() - interval '1 second' WHERE seq = $1"),
            &[&later],
        )
        .await
        .expect("parked, its recheck come");
    later
}

/// What the operator does to key `k`'s dead letter.
#[derive(Clone, Copy, Debug)]
enum Command {
    Discard,
    Retry,
}

/// Runs `command` on key `k`'s dead letter while a claim holds the parked
/// row that came due, lets the claim set it aside, then asserts the row is
/// due now.
async fn parked_row_comes_back_after(command: Command) {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let later = parked_key(&db).await;
    let claim = claim_locking(&db, later).await;
    let run = {
        let (config, schema) = (db.config.clone(), db.schema.clone());
        tokio::spawn(async move {
            let client = connect(&config).await;
            let filter = Filter {
                key: Some("k".into()),
                ..Filter::default()
            };
            match command {
                Command::Discard => ops::discard(&client, &schema, &filter).await,
                Command::Retry => ops::retry(&client, &schema, &filter).await,
            }
        })
    };
    finished_or_waiting(&db, &run).await;
    claim_sets_aside(&db, &claim, later).await;
    assert_eq!(
        run.await.expect("joined").expect("command"),
        1,
        "{command:?}"
    );
    assert!(
        due_now(&db, later).await,
        "the parked row stayed set aside after its key's dead letter went ({command:?})"
    );
    db.cleanup().await;
}

#[tokio::test]
async fn a_discard_while_a_claim_sets_the_parked_rows_aside_still_brings_them_back() {
    parked_row_comes_back_after(Command::Discard).await;
}

#[tokio::test]
async fn a_retry_while_a_claim_sets_the_parked_rows_aside_still_brings_them_back() {
    parked_row_comes_back_after(Command::Retry).await;
}

#[tokio::test]
async fn a_resume_while_a_claim_sets_the_paused_rows_aside_still_brings_them_back() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let id = db
        .outbox()
        .enqueue(
            &db.client,
            &Message::builder("d")
                .key("k")
                .json(&0)
                .build()
                .expect("valid"),
        )
        .await
        .expect("enqueue");
    let seq = seq_of(&db, &id).await;
    ops::pause(&db.client, &db.schema, "d", Some("test"))
        .await
        .expect("pause");
    db.client
        .execute(
            &format!(
                "UPDATE {} SET next_attempt_at = now() - interval '1 second' WHERE seq = $1",
                db.table()
            ),
            &[&seq],
        )
        .await
        .expect("set aside while paused, its recheck come");
    let claim = claim_locking(&db, seq).await;
    let resume = {
        let (config, schema) = (db.config.clone(), db.schema.clone());
        tokio::spawn(async move {
            let client = connect(&config).await;
            ops::resume(&client, &schema, "d").await
        })
    };
    finished_or_waiting(&db, &resume).await;
    claim_sets_aside(&db, &claim, seq).await;
    assert_eq!(
        resume.await.expect("joined").expect("resume"),
        1,
        "the row set aside is counted as brought back"
    );
    assert!(
        due_now(&db, seq).await,
        "the paused destination's row stayed set aside after the resume"
    );
    db.cleanup().await;
}
