//! Retention mode: published rows kept with the broker's receipt (RabbitMQ
//! confirm, Kafka partition and offset), and the cleanup of expired rows.

use std::time::Duration;

use outbox_client::Message;
use outbox_tests::amqp::Fixture;
use outbox_tests::db::TestDb;
use outbox_tests::{eventually, fast_settings, InProcessRelay};

use super::{cli, msg, PATIENCE};

fn retention_settings(retention: Duration, cleanup_batch: i64) -> outbox_relay::Settings {
    outbox_relay::Settings {
        retention: Some(retention),
        retention_cleanup_batch: cleanup_batch,
        ..fast_settings()
    }
}

/// Enqueues `n` messages for `destination` over `keys` keys, then waits for
/// `delivered` to count them all and for all `n` rows to be kept in
/// `published`; returns their ids.
async fn deliver_and_retain(
    db: &TestDb,
    destination: &str,
    n: i32,
    keys: i32,
    delivered: impl Fn() -> usize,
) -> Vec<outbox_client::MessageId> {
    let batch: Vec<Message> = (0..n)
        .map(|i| msg(destination, &format!("k{}", i % keys), i))
        .collect();
    let ids = db
        .outbox()
        .enqueue_batch(&db.client, &batch)
        .await
        .expect("enqueue");
    assert!(eventually(PATIENCE, || async { delivered() >= n as usize }).await);
    assert!(
        eventually(PATIENCE, || async {
            db.count("published").await == i64::from(n)
        })
        .await
    );
    ids
}

/// Retention mode on RabbitMQ: every confirmed row moves to `published` with
/// its publish time and confirm, and `locate` reports it.
#[tokio::test]
async fn retention_keeps_published_rows_with_amqp_receipts() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let relay = InProcessRelay::amqp(&db, retention_settings(Duration::from_secs(3600), 1000));
    let ids = deliver_and_retain(&db, &rabbit.exchange, 500, 10, || rabbit.count()).await;
    relay.stop().await;
    assert_eq!(db.pending().await, 0);

    let rows = db
        .client
        .query(
            &format!(
                "SELECT message_id, receipt, published_at >= created_at FROM {}.published",
                db.schema.quoted()
            ),
            &[],
        )
        .await
        .expect("published rows");
    let kept: std::collections::HashSet<uuid::Uuid> = rows.iter().map(|r| r.get(0)).collect();
    let enqueued: std::collections::HashSet<uuid::Uuid> = ids.iter().map(|i| i.as_uuid()).collect();
    assert_eq!(kept, enqueued);
    for r in &rows {
        let receipt: serde_json::Value = r.get(1);
        assert_eq!(receipt["broker"], "rabbitmq", "{receipt}");
        assert_eq!(receipt["confirm"], "ack", "{receipt}");
        assert_eq!(receipt["exchange"], rabbit.exchange.as_str(), "{receipt}");
        assert!(r.get::<_, bool>(2), "published before it was written");
    }

    let (code, out, _) = cli(&db, &["locate", &ids[7].to_string(), "--json"]).await;
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["state"], "published", "{v}");
    assert_eq!(v["destination"], rabbit.exchange.as_str());
    assert_eq!(v["receipt"]["confirm"], "ack");
    let (_, out, _) = cli(&db, &["locate", &ids[7].to_string()]).await;
    assert!(
        out.contains("published to") && out.contains("rabbitmq confirm ack"),
        "{out}"
    );
    // The relay has stopped: the report still comes, and the exit code says
    // that nothing is running.
    let (code, out, _) = cli(&db, &["status", "--json"]).await;
    assert_eq!(code, 1);
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["published_retained"]["count"], 500, "{v}");
    let (_, out, _) = cli(&db, &["status"]).await;
    assert!(out.contains("kept for retention: 500"), "{out}");
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// Retention mode on Kafka: each kept row's receipt names the partition and
/// offset where an independent consumer found that very message.
#[tokio::test]
async fn retention_receipts_match_kafka_partitions_and_offsets() {
    outbox_tests::init_logging();
    let brokers = outbox_tests::kafka_brokers();
    let db = TestDb::new().await;
    let topic = outbox_tests::kafka::Fixture::new(&brokers, 3).await;
    let relay = InProcessRelay::kafka(
        &db,
        &brokers,
        &[],
        retention_settings(Duration::from_secs(3600), 1000),
    );
    let ids = deliver_and_retain(&db, &topic.topic, 300, 30, || topic.count()).await;
    relay.stop().await;

    let seen: std::collections::HashMap<String, (i32, i64)> = topic
        .records()
        .into_iter()
        .map(|r| {
            (
                r.headers.get("message-id").cloned().unwrap_or_default(),
                (r.partition, r.offset),
            )
        })
        .collect();
    let rows = db
        .client
        .query(
            &format!(
                "SELECT message_id, receipt FROM {}.published",
                db.schema.quoted()
            ),
            &[],
        )
        .await
        .expect("published rows");
    assert_eq!(rows.len(), ids.len());
    for r in &rows {
        let id: uuid::Uuid = r.get(0);
        let receipt: serde_json::Value = r.get(1);
        assert_eq!(receipt["broker"], "kafka", "{receipt}");
        assert_eq!(receipt["topic"], topic.topic.as_str(), "{receipt}");
        let at = (
            receipt["partition"].as_i64().expect("partition") as i32,
            receipt["offset"].as_i64().expect("offset"),
        );
        assert_eq!(
            seen.get(&id.to_string()),
            Some(&at),
            "receipt {receipt} for {id}"
        );
    }
    let (_, out, _) = cli(&db, &["locate", &ids[0].to_string()]).await;
    assert!(
        out.contains("kafka topic") && out.contains("offset"),
        "{out}"
    );
    topic.stop().await;
    db.cleanup().await;
}

/// The cleanup deletes rows past retention in bounded statements, and only
/// those: rows still inside the retention stay.
#[tokio::test]
async fn retention_cleanup_deletes_only_expired_rows_in_bounded_batches() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let s = db.schema.quoted();
    let fill = |age: &'static str, n: i32, from: i32| {
        format!(
            "INSERT INTO {s}.published (seq, message_id, destination, routing_key, headers, payload, \
                                       created_at, attempts, published_at, receipt) \
             SELECT g, gen_random_uuid(), 'd', '', '{{}}', '', now() - interval '{age}', 0, \
                    now() - interval '{age}', '{{\"broker\":\"rabbitmq\",\"confirm\":\"ack\"}}' \
             FROM generate_series({from}, {}) g",
            from + n - 1
        )
    };
    db.client
        .batch_execute(&fill("2 hours", 5000, 1))
        .await
        .expect("expired rows");
    db.client
        .batch_execute(&fill("1 minute", 10, 100_000))
        .await
        .expect("recent rows");

    // One cleanup statement removes at most its batch size.
    let queries = outbox_relay::source::claim::Queries::new(&db.schema, true, true);
    let first = queries
        .purge_published(&db.client, Duration::from_secs(3600), 100)
        .await
        .expect("purge");
    assert_eq!(first, 100);
    assert_eq!(db.count("published").await, 5010 - 100);

    // The relay's cleanup task takes the rest, batch by batch.
    let relay = InProcessRelay::amqp(&db, retention_settings(Duration::from_secs(3600), 250));
    assert!(
        eventually(PATIENCE, || async { db.count("published").await == 10 }).await,
        "expired rows left: {}",
        db.count("published").await
    );
    relay.stop().await;
    let oldest: f64 = db
        .client
        .query_one(
            &format!(
                "SELECT extract(epoch FROM now() - min(published_at))::float8 FROM {s}.published"
            ),
            &[],
        )
        .await
        .expect("oldest")
        .get(0);
    assert!(oldest < 3600.0, "an expired row survived: {oldest}s old");
    db.cleanup().await;
}

/// Retention mode across a sequence set back (`TRUNCATE ... RESTART
/// IDENTITY`, `setval`), which the relay follows (its claim floor starts
/// again from 0): new rows take seqs that rows kept in `published` still
/// have. Before, moving such a row there broke `published`'s key, the
/// settle of its batch rolled back, and the batch was published again at
/// every claim until the old row's retention ran out.
#[tokio::test]
async fn retention_across_a_sequence_set_back_settles_each_row_once() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let relay = InProcessRelay::amqp(&db, retention_settings(Duration::from_secs(3600), 1000));
    deliver_and_retain(&db, &rabbit.exchange, 50, 5, || rabbit.count()).await;
    db.client
        .batch_execute(&format!("TRUNCATE {} RESTART IDENTITY", db.table()))
        .await
        .expect("restart the sequence");
    let batch: Vec<Message> = (0..50)
        .map(|i| msg(&rabbit.exchange, &format!("k{}", i % 5), 100 + i))
        .collect();
    let ids: Vec<String> = db
        .outbox()
        .enqueue_batch(&db.client, &batch)
        .await
        .expect("enqueue")
        .iter()
        .map(|i| i.to_string())
        .collect();
    // Received by the consumer too, the 50 before and the 50 since.
    let settled = eventually(Duration::from_secs(30), || async {
        db.pending().await == 0 && rabbit.count() >= 100
    })
    .await;
    let delivered = rabbit.message_ids();
    let copies: Vec<usize> = ids
        .iter()
        .map(|id| delivered.iter().filter(|d| *d == id).count())
        .collect();
    relay.stop().await;
    assert!(
        settled,
        "{} of 50 rows still in the outbox; copies delivered: {copies:?}",
        db.pending().await
    );
    assert!(
        copies.iter().all(|&n| n == 1),
        "copies delivered: {copies:?}"
    );
    // The newest row under each seq is the one kept.
    let kept: std::collections::HashSet<String> = db
        .client
        .query(
            &format!(
                "SELECT message_id::text FROM {}.published WHERE seq <= 50",
                db.schema.quoted()
            ),
            &[],
        )
        .await
        .expect("published")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        kept,
        ids.iter().cloned().collect(),
        "published after the set-back"
    );
    rabbit.cleanup().await;
    db.cleanup().await;
}
