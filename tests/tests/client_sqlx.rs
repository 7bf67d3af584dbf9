//! outbox-client's sqlx path (feature `sqlx`) against a real Postgres: the
//! same rows as the tokio-postgres path for the same messages, and the same
//! errors.

use outbox_client::{Error, Message, MessageId, MessageIdOrBatch, Outbox};
use outbox_tests::db::TestDb;
use rand::{Rng, SeedableRng};
use sqlx::{Connection, PgConnection};

async fn sqlx_connection() -> PgConnection {
    PgConnection::connect(&outbox_tests::pg_url())
        .await
        .expect("sqlx connects to postgres")
}

/// A random mix of what a message can carry: with and without key, routing
/// key, headers, event type, caller-chosen id, JSON or raw payloads of
/// random sizes, empty payloads.
fn random_messages(rng: &mut impl Rng, n: usize) -> Vec<Message> {
    (0..n)
        .map(|i| {
            let mut b = Message::builder(format!("dest-{}", rng.random_range(0..3)));
            if rng.random_bool(0.7) {
                b = b.key(format!("key-{}", rng.random_range(0..5)));
            }
            if rng.random_bool(0.5) {
                b = b.routing_key(format!("rk.{i}"));
            }
            for h in 0..rng.random_range(0..3) {
                b = b.header(format!("x-h{h}"), format!("v{}", rng.random::<u16>()));
            }
            if rng.random_bool(0.5) {
                b = b.event_type(format!("com.example.e{}", rng.random_range(0..4)));
            }
            b = match rng.random_range(0..3) {
                0 => b.json(&serde_json::json!({"i": i, "r": rng.random::<u32>()})),
                1 => {
                    let len = rng.random_range(0..4096);
                    b.payload((0..len).map(|_| rng.random::<u8>()).collect::<Vec<u8>>())
                }
                _ => b.payload(Vec::new()).content_type("text/plain"),
            };
            // Every message gets an id here so that both paths write the same
            // ones; the paths' own id generation is checked separately.
            b.message_id(MessageId::new_v7()).build().expect("valid")
        })
        .collect()
}

/// Every column a writer sets or defaults, in seq order.
async fn rows_of(db: &TestDb) -> Vec<String> {
    db.client
        .query(
            &format!(
                "SELECT to_jsonb(m) - 'seq' - 'created_at' FROM {} m ORDER BY seq",
                db.table()
            ),
            &[],
        )
        .await
        .expect("select rows")
        .iter()
        .map(|r| r.get::<_, serde_json::Value>(0).to_string())
        .collect()
}

#[tokio::test]
async fn sqlx_and_tokio_postgres_write_identical_rows() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(outbox_tests::seed());
    let messages = random_messages(&mut rng, 300);
    // The same sequence of single enqueues and batches on both paths.
    let mut cuts = vec![0];
    while *cuts.last().expect("non-empty") < messages.len() {
        let last = *cuts.last().expect("non-empty");
        cuts.push((last + rng.random_range(1..40)).min(messages.len()));
    }

    let mut by_pg = TestDb::new().await;
    let outbox = by_pg.outbox();
    let tx = by_pg.client.transaction().await.expect("begin");
    for w in cuts.windows(2) {
        let chunk = &messages[w[0]..w[1]];
        if chunk.len() == 1 {
            outbox.enqueue(&tx, &chunk[0]).await.expect("enqueue");
        } else {
            outbox.enqueue_batch(&tx, chunk).await.expect("batch");
        }
    }
    tx.commit().await.expect("commit");

    let by_sqlx = TestDb::new().await;
    let outbox = by_sqlx.outbox();
    let mut conn = sqlx_connection().await;
    let mut tx = conn.begin().await.expect("begin");
    for w in cuts.windows(2) {
        let chunk = &messages[w[0]..w[1]];
        if chunk.len() == 1 {
            let id = outbox
                .enqueue_sqlx(&mut tx, &chunk[0])
                .await
                .expect("enqueue");
            assert_eq!(Some(id), chunk[0].message_id());
        } else {
            let ids = outbox
                .enqueue_batch_sqlx(&mut tx, chunk)
                .await
                .expect("batch");
            assert_eq!(ids.len(), chunk.len());
        }
    }
    tx.commit().await.expect("commit");

    let (a, b) = (rows_of(&by_pg).await, rows_of(&by_sqlx).await);
    assert_eq!(a.len(), messages.len());
    for (i, (a, b)) in a.iter().zip(&b).enumerate() {
        assert_eq!(a, b, "row {i} differs between tokio-postgres and sqlx");
    }
    assert_eq!(a.len(), b.len());
    let typed = messages.iter().filter(|m| m.event_type().is_some()).count();
    let stored: i64 = by_sqlx
        .client
        .query_one(
            &format!("SELECT count(event_type) FROM {}", by_sqlx.table()),
            &[],
        )
        .await
        .expect("count")
        .get(0);
    assert_eq!(stored, typed as i64, "every event type is stored");
    by_pg.cleanup().await;
    by_sqlx.cleanup().await;
}

#[tokio::test]
async fn sqlx_rollback_writes_nothing_and_ids_are_v7() {
    let db = TestDb::new().await;
    let outbox = db.outbox();
    let mut conn = sqlx_connection().await;
    let message = Message::builder("d").payload("p").build().expect("valid");

    let mut tx = conn.begin().await.expect("begin");
    outbox
        .enqueue_sqlx(&mut tx, &message)
        .await
        .expect("enqueue");
    tx.rollback().await.expect("rollback");
    assert_eq!(db.pending().await, 0);

    let mut tx = conn.begin().await.expect("begin");
    let one = outbox
        .enqueue_sqlx(&mut tx, &message)
        .await
        .expect("enqueue");
    let many = outbox
        .enqueue_batch_sqlx(&mut tx, &[message.clone(), message.clone()])
        .await
        .expect("batch");
    tx.commit().await.expect("commit");
    assert_eq!(db.pending().await, 3);
    for id in std::iter::once(one).chain(many) {
        assert_eq!(id.0.get_version_num(), 7, "default ids are UUIDv7");
    }
    // An empty batch sends nothing and fails nothing.
    assert!(outbox
        .enqueue_batch_sqlx(&mut conn, &[])
        .await
        .expect("empty batch")
        .is_empty());
    db.cleanup().await;
}

#[tokio::test]
async fn sqlx_reports_the_same_typed_errors() {
    let db = TestDb::new().await;
    let outbox = db.outbox().max_payload_bytes(10);
    let mut conn = sqlx_connection().await;

    // Too large: refused before any SQL, so the transaction can still commit.
    let mut tx = conn.begin().await.expect("begin");
    let big = Message::builder("d")
        .payload(vec![0u8; 11])
        .build()
        .expect("valid");
    let small = Message::builder("d").payload("ok").build().expect("valid");
    match outbox.enqueue_sqlx(&mut tx, &big).await {
        Err(
            e @ Error::PayloadTooLarge {
                size: 11,
                limit: 10,
            },
        ) => assert!(e.is_invalid_input()),
        other => panic!("expected PayloadTooLarge, got {other:?}"),
    }
    match outbox
        .enqueue_batch_sqlx(&mut tx, &[small.clone(), big])
        .await
    {
        Err(Error::PayloadTooLarge { .. }) => {}
        other => panic!("expected PayloadTooLarge for the batch, got {other:?}"),
    }
    outbox
        .enqueue_sqlx(&mut tx, &small)
        .await
        .expect("still usable");
    tx.commit().await.expect("commit");
    assert_eq!(
        db.pending().await,
        1,
        "nothing of the refused batch was written"
    );

    // A caller-chosen id that is already there, alone and in a batch.
    let id = MessageId::new_v7();
    let with_id = Message::builder("d").message_id(id).build().expect("valid");
    outbox
        .enqueue_sqlx(&mut conn, &with_id)
        .await
        .expect("first");
    match outbox.enqueue_sqlx(&mut conn, &with_id).await {
        Err(Error::DuplicateMessageId {
            message_id: MessageIdOrBatch::Message(dup),
            ..
        }) => assert_eq!(dup, id),
        other => panic!("expected DuplicateMessageId, got {other:?}"),
    }
    match outbox
        .enqueue_batch_sqlx(&mut conn, std::slice::from_ref(&with_id))
        .await
    {
        Err(Error::DuplicateMessageId {
            message_id: MessageIdOrBatch::Batch,
            ..
        }) => {}
        other => panic!("expected DuplicateMessageId for the batch, got {other:?}"),
    }

    // A schema that was never migrated.
    let missing = Outbox::new(&outbox_tests::unique("nomigrate")).expect("valid name");
    match missing.enqueue_sqlx(&mut conn, &small).await {
        Err(e @ Error::SchemaMissing { .. }) => {
            assert!(e.to_string().contains("run the migrations"), "{e}")
        }
        other => panic!("expected SchemaMissing, got {other:?}"),
    }
    db.cleanup().await;
}

/// A client of this version on a schema one migration behind (no
/// `event_type` column, as before V8): messages without an event type are
/// written; one with an event type is refused with the fix named, on both
/// paths.
#[tokio::test]
async fn a_schema_without_event_types_takes_untyped_messages_and_names_the_fix_for_typed() {
    let mut db = TestDb::new().await;
    db.client
        .batch_execute(&format!(
            "ALTER TABLE {} DROP COLUMN event_type",
            db.table()
        ))
        .await
        .expect("drop column");
    let outbox = db.outbox();
    let plain = Message::builder("d").payload("p").build().expect("valid");
    let typed = Message::builder("d")
        .event_type("order.paid")
        .build()
        .expect("valid");

    let tx = db.client.transaction().await.expect("begin");
    outbox
        .enqueue(&tx, &plain)
        .await
        .expect("untyped on tokio-postgres");
    match outbox.enqueue(&tx, &typed).await {
        Err(e @ Error::SchemaMissing { .. }) => {
            assert!(e.to_string().contains("run the migrations"), "{e}")
        }
        other => panic!("expected SchemaMissing, got {other:?}"),
    }
    drop(tx);

    let mut conn = sqlx_connection().await;
    outbox
        .enqueue_sqlx(&mut conn, &plain)
        .await
        .expect("untyped on sqlx");
    match outbox
        .enqueue_batch_sqlx(&mut conn, &[plain.clone(), typed])
        .await
    {
        Err(Error::SchemaMissing { .. }) => {}
        other => panic!("expected SchemaMissing, got {other:?}"),
    }
    assert_eq!(db.pending().await, 1);
    db.cleanup().await;
}
