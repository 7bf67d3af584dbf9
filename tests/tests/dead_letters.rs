//! Poison messages, parking, dead-letter retry/discard, and the operator CLI.

use std::time::Duration;

use outbox_client::{Message, MessageId};
use outbox_tests::amqp::{self, Fixture};
use outbox_tests::db::TestDb;
use outbox_tests::{eventually, fast_settings, InProcessRelay};
use tokio::process::Command;

const RELAY_BIN: &str = env!("CARGO_BIN_EXE_outbox-relay-under-test");
const PATIENCE: Duration = Duration::from_secs(120);

fn settings(park: bool) -> outbox_relay::Settings {
    outbox_relay::Settings {
        max_attempts: 3,
        retry_base: Duration::from_millis(50),
        retry_max: Duration::from_millis(200),
        park_on_dead_letter: park,
        ..fast_settings()
    }
}

/// Runs the relay CLI against `db` and returns (exit code, stdout, stderr).
async fn cli(db: &TestDb, args: &[&str]) -> (i32, String, String) {
    let (code, out, err) = outbox_tests::process::cli(RELAY_BIN, db.schema.as_str(), args).await;
    (code.unwrap_or(-1), out, err)
}

async fn dead_count(db: &TestDb) -> i64 {
    db.client
        .query_one(
            &format!("SELECT count(*) FROM {}.dead_letters", db.schema.quoted()),
            &[],
        )
        .await
        .expect("count")
        .get(0)
}

fn msg(dest: &str, key: &str, n: i32) -> Message {
    Message::builder(dest)
        .key(key)
        .json(&n)
        .build()
        .expect("valid")
}

/// A relay, a test queue on RabbitMQ, and `side`: an exchange bound to no
/// queue, so whatever is published there comes back unroutable.
struct Setup {
    db: TestDb,
    rabbit: Fixture,
    side: String,
    relay: InProcessRelay,
}

impl Setup {
    async fn new(park: bool) -> Setup {
        outbox_tests::init_logging();
        let db = TestDb::new().await;
        let rabbit = Fixture::new().await;
        let side = outbox_tests::unique("side");
        amqp::declare_unbound_exchange(&side).await;
        let relay = InProcessRelay::amqp(&db, settings(park));
        Setup {
            db,
            rabbit,
            side,
            relay,
        }
    }

    async fn finish(self) {
        self.relay.stop().await;
        amqp::delete_exchange(&self.side).await;
        self.rabbit.cleanup().await;
        self.db.cleanup().await;
    }
}

#[tokio::test]
async fn poison_message_dead_letters_while_10000_others_flow() {
    let setup = Setup::new(true).await;
    let (db, rabbit) = (&setup.db, &setup.rabbit);
    let outbox = db.outbox();
    let poison = outbox
        .enqueue(&db.client, &msg(&setup.side, "p", 0))
        .await
        .expect("enqueue");
    for chunk in 0..10 {
        let batch: Vec<Message> = (0..1000)
            .map(|i| msg(&rabbit.exchange, &format!("k{}", i % 100), chunk * 1000 + i))
            .collect();
        outbox
            .enqueue_batch(&db.client, &batch)
            .await
            .expect("enqueue");
    }
    assert!(
        eventually(PATIENCE, || async { rabbit.count() >= 10_000 }).await,
        "others blocked"
    );
    assert!(
        eventually(PATIENCE, || async { dead_count(db).await == 1 }).await,
        "poison not dead-lettered"
    );
    let (code, out, _) = cli(db, &["locate", &poison.to_string(), "--json"]).await;
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["state"], "dead_lettered");
    assert_eq!(v["attempts"], 3);
    assert!(
        v["last_error"]
            .as_str()
            .unwrap_or("")
            .contains("unroutable"),
        "{v}"
    );
    assert_eq!(db.pending().await, 0);
    setup.finish().await;
}

/// A poison message parks only its own key; fixing the binding and retrying it
/// from the dead letters delivers the key's messages in order.
#[tokio::test]
async fn parking_holds_back_one_key_and_retry_delivers_in_order() {
    let setup = Setup::new(true).await;
    let (db, rabbit, side) = (&setup.db, &setup.rabbit, setup.side.as_str());
    let outbox = db.outbox();

    // Key "k": its first message goes to an exchange nobody listens on yet.
    let first = outbox
        .enqueue(&db.client, &msg(side, "k", 0))
        .await
        .expect("enqueue");
    let mut later: Vec<MessageId> = Vec::new();
    for n in 1..=3 {
        later.push(
            outbox
                .enqueue(&db.client, &msg(&rabbit.exchange, "k", n))
                .await
                .expect("enqueue"),
        );
    }
    let others: Vec<Message> = (0..50)
        .map(|i| msg(&rabbit.exchange, &format!("o{i}"), i))
        .collect();
    outbox
        .enqueue_batch(&db.client, &others)
        .await
        .expect("enqueue");

    assert!(
        eventually(PATIENCE, || async { dead_count(db).await == 1 }).await,
        "not dead-lettered"
    );
    assert!(
        eventually(PATIENCE, || async { rabbit.count() >= 50 }).await,
        "other keys blocked"
    );
    // `locate` names what a later message of the key waits for.
    let (code, out, _) = cli(db, &["locate", &later[0].to_string(), "--json"]).await;
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["state"], "parked", "{v}");
    assert_eq!(v["behind_dead_letter"], first.to_string(), "{v}");
    let (_, human, _) = cli(db, &["locate", &later[0].to_string()]).await;
    assert!(
        human.contains("parked behind dead letter") && human.contains(&first.to_string()),
        "{human}"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let ids: Vec<String> = rabbit
        .deliveries()
        .iter()
        .map(|d| d.message_id.clone())
        .collect();
    for id in &later {
        assert!(
            !ids.contains(&id.to_string()),
            "parked message {id} overtook the dead letter"
        );
    }
    let (code, out, _) = cli(db, &["status", "--json"]).await;
    assert_eq!(code, 0);
    let status: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(status["dead_letters"], 1);
    assert_eq!(status["parked_keys"][0]["key"], "k");
    assert_eq!(status["parked_keys"][0]["waiting"], 3);
    let (_, human, _) = cli(db, &["status"]).await;
    assert!(human.contains("parked key \"k\": 3 waiting"), "{human}");

    // Fix the binding: the test queue now also hears the side exchange.
    amqp::bind_fixture_queue(rabbit, side).await;
    let (code, out, err) = cli(
        db,
        &["dead-letters", "retry", "--key", "k", "--yes", "--json"],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&out).expect("json")["retried"],
        1
    );
    assert!(
        eventually(PATIENCE, || async { rabbit.count() >= 54 }).await,
        "key not unparked"
    );
    let order: Vec<String> = rabbit
        .deliveries()
        .iter()
        .map(|d| d.message_id.clone())
        .filter(|id| *id == first.to_string() || later.iter().any(|l| l.to_string() == *id))
        .collect();
    let expected: Vec<String> = std::iter::once(first)
        .chain(later)
        .map(|i| i.to_string())
        .collect();
    assert_eq!(order, expected, "key k out of order after retry");
    assert_eq!(dead_count(db).await, 0);
    setup.finish().await;
}

#[tokio::test]
async fn skip_setting_lets_later_messages_pass() {
    let setup = Setup::new(false).await;
    let (db, rabbit, side) = (&setup.db, &setup.rabbit, setup.side.as_str());
    let outbox = db.outbox();
    outbox
        .enqueue(&db.client, &msg(side, "k", 0))
        .await
        .expect("enqueue");
    for n in 1..=3 {
        outbox
            .enqueue(&db.client, &msg(&rabbit.exchange, "k", n))
            .await
            .expect("enqueue");
    }
    assert!(
        eventually(PATIENCE, || async { rabbit.count() >= 3 }).await,
        "skip mode still parks"
    );
    assert!(eventually(PATIENCE, || async { dead_count(db).await == 1 }).await);
    setup.finish().await;
}

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
    assert!(eventually(PATIENCE, || async { dead_count(&db).await == 1 }).await);
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
    assert_eq!(dead_count(&db).await, 1);

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

fn retention_settings(retention: Duration, cleanup_batch: i64) -> outbox_relay::Settings {
    outbox_relay::Settings {
        retention: Some(retention),
        retention_cleanup_batch: cleanup_batch,
        ..fast_settings()
    }
}

async fn published_count(db: &TestDb) -> i64 {
    db.client
        .query_one(
            &format!("SELECT count(*) FROM {}.published", db.schema.quoted()),
            &[],
        )
        .await
        .expect("count")
        .get(0)
}

/// Retention mode on RabbitMQ: every confirmed row moves to `published` with
/// its publish time and confirm, and `locate` reports it.
#[tokio::test]
async fn retention_keeps_published_rows_with_amqp_receipts() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let relay = InProcessRelay::amqp(&db, retention_settings(Duration::from_secs(3600), 1000));
    let batch: Vec<Message> = (0..500)
        .map(|i| msg(&rabbit.exchange, &format!("k{}", i % 10), i))
        .collect();
    let ids = db
        .outbox()
        .enqueue_batch(&db.client, &batch)
        .await
        .expect("enqueue");
    assert!(eventually(PATIENCE, || async { rabbit.count() >= 500 }).await);
    assert!(eventually(PATIENCE, || async { published_count(&db).await == 500 }).await);
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
    let batch: Vec<Message> = (0..300)
        .map(|i| msg(&topic.topic, &format!("k{}", i % 30), i))
        .collect();
    let ids = db
        .outbox()
        .enqueue_batch(&db.client, &batch)
        .await
        .expect("enqueue");
    assert!(eventually(PATIENCE, || async { topic.count() >= 300 }).await);
    assert!(eventually(PATIENCE, || async { published_count(&db).await == 300 }).await);
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
    assert_eq!(published_count(&db).await, 5010 - 100);

    // The relay's cleanup task takes the rest, batch by batch.
    let relay = InProcessRelay::amqp(&db, retention_settings(Duration::from_secs(3600), 250));
    assert!(
        eventually(PATIENCE, || async { published_count(&db).await == 10 }).await,
        "expired rows left: {}",
        published_count(&db).await
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
