//! `--cloudevents`: the relay process publishes CloudEvents 1.0 in binary
//! content mode, and the Python `cloudevents` SDK, reading through its own
//! RabbitMQ and Kafka bindings, parses every message from both brokers into
//! the event the row describes.

use std::collections::HashMap;
use std::time::UNIX_EPOCH;

use base64::Engine;
use outbox_client::Message;
use outbox_tests::db::TestDb;
use outbox_tests::process::{cli, RelayProcess};
use outbox_tests::python::{self, Reader};
use rand::{Rng, SeedableRng};

const RELAY_BIN: &str = env!("CARGO_BIN_EXE_outbox-relay-under-test");
const MESSAGES: usize = 300;
const SOURCE: &str = "/tests/orders-service";

/// What a row should become as an event.
struct Expected {
    event_type: String,
    /// None where the row's is empty: no `datacontenttype` then.
    content_type: Option<String>,
    created_us: i64,
    payload: Vec<u8>,
}

/// Enqueues a random mix (typed and untyped, JSON and raw bytes, some rows
/// with headers that spell CloudEvents attributes) and returns each
/// message's expected event by message id.
async fn enqueue(db: &mut TestDb, destination: &str, seed: u64) -> HashMap<String, Expected> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let messages: Vec<Message> = (0..MESSAGES)
        .map(|i| {
            let mut b = Message::builder(destination).key(format!("k{}", rng.random_range(0..8)));
            if rng.random_bool(0.6) {
                b = b.event_type(format!("com.example.order.e{}", rng.random_range(0..3)));
            }
            if i % 50 == 0 {
                // A row header may not pass itself off as an attribute.
                b = b.header("ce_type", "spoofed").header("ce-id", "spoofed");
            }
            if rng.random_bool(0.5) {
                b.json(&serde_json::json!({"order": i, "n": rng.random::<u32>()}))
            } else {
                let len = rng.random_range(1..512);
                b.payload((0..len).map(|_| rng.random::<u8>()).collect::<Vec<u8>>())
            }
            .build()
            .expect("valid")
        })
        .collect();
    let outbox = db.outbox();
    let tx = db.client.transaction().await.expect("begin");
    outbox.enqueue_batch(&tx, &messages).await.expect("enqueue");
    tx.commit().await.expect("commit");
    // Plain SQL may write an empty event type and content type, which the
    // client and enqueue() refuse; neither may make an invalid event (an
    // empty `type` or `datacontenttype`).
    db.client
        .execute(
            &format!(
                "UPDATE {t} SET event_type = '', content_type = '' \
                 WHERE seq IN (SELECT seq FROM {t} ORDER BY seq OFFSET 5 LIMIT 7)",
                t = db.table()
            ),
            &[],
        )
        .await
        .expect("empty strings");
    let rows = db
        .client
        .query(
            &format!(
                "SELECT message_id::text, created_at FROM {} ORDER BY seq",
                db.table()
            ),
            &[],
        )
        .await
        .expect("select");
    assert_eq!(rows.len(), MESSAGES);
    rows.iter()
        .zip(&messages)
        .enumerate()
        .map(|(i, (row, m))| {
            let emptied = (5..12).contains(&i);
            let created: std::time::SystemTime = row.get(1);
            let created_us = created
                .duration_since(UNIX_EPOCH)
                .expect("after the epoch")
                .as_micros() as i64;
            (
                row.get::<_, String>(0),
                Expected {
                    event_type: match emptied {
                        true => destination.to_owned(),
                        false => m.event_type().unwrap_or(destination).to_owned(),
                    },
                    content_type: (!emptied)
                        .then(|| m.content_type().expect("build sets one").to_owned()),
                    created_us,
                    payload: m.payload().to_vec(),
                },
            )
        })
        .collect()
}

fn reader_args(args: &[&str]) -> Vec<String> {
    std::iter::once(python::script("cloudevents_reader.py"))
        .chain(args.iter().map(|a| (*a).to_owned()))
        .collect()
}

fn check_events(events: &[serde_json::Value], expected: &HashMap<String, Expected>) {
    assert_eq!(events.len(), expected.len(), "every message arrived once");
    let mut seen = std::collections::HashSet::new();
    for e in events {
        let id = e["id"].as_str().expect("id");
        let want = expected
            .get(id)
            .unwrap_or_else(|| panic!("event id {id} is no message's id: {e}"));
        assert!(seen.insert(id.to_owned()), "{id} arrived twice");
        assert_eq!(e["relay_message_id"], id, "ce id = the message id");
        assert_eq!(e["source"], SOURCE);
        assert_eq!(e["specversion"], "1.0");
        assert_eq!(e["type"], want.event_type.as_str(), "{e}");
        assert_eq!(
            e["datacontenttype"].as_str(),
            want.content_type.as_deref(),
            "{e}"
        );
        assert_eq!(e["time_us"], want.created_us, "ce time = created_at: {e}");
        let body = base64::engine::general_purpose::STANDARD
            .decode(e["payload_b64"].as_str().expect("payload"))
            .expect("base64");
        assert_eq!(body, want.payload, "the body is the payload, untouched");
        if want.content_type.as_deref() == Some("application/json") {
            let parsed: serde_json::Value = serde_json::from_slice(&want.payload).expect("json");
            assert_eq!(e["data"], parsed, "the SDK reads the JSON data");
        }
    }
}

#[tokio::test]
async fn rabbitmq_messages_parse_as_cloudevents() {
    let mut db = TestDb::new().await;
    let exchange = outbox_tests::unique("ce");
    outbox_tests::amqp::declare_unbound_exchange(&exchange).await;
    let expected = enqueue(&mut db, &exchange, outbox_tests::seed()).await;
    let reader = Reader::start(&reader_args(&[
        "amqp",
        &outbox_tests::amqp_url(),
        &exchange,
        &MESSAGES.to_string(),
        "120",
    ]))
    .await;
    let mut relay = RelayProcess::start(
        RELAY_BIN,
        &[
            ("OUTBOX_SCHEMA", db.schema.to_string()),
            ("OUTBOX_CLOUDEVENTS", "true".into()),
            ("OUTBOX_CLOUDEVENTS_SOURCE", SOURCE.into()),
            ("OUTBOX_POLL_INTERVAL", "100ms".into()),
        ],
    );
    let events = reader.collect().await;
    check_events(&events, &expected);
    relay.signal("TERM").await;
    relay.wait().await;
    outbox_tests::amqp::delete_exchange(&exchange).await;
    db.cleanup().await;
}

#[tokio::test]
async fn kafka_records_parse_as_cloudevents() {
    let mut db = TestDb::new().await;
    let brokers = outbox_tests::kafka_brokers();
    let topic = outbox_tests::unique("ce");
    outbox_tests::kafka::create_topic(&brokers, &topic, 3).await;
    let expected = enqueue(&mut db, &topic, outbox_tests::seed()).await;
    let mut relay = RelayProcess::start(
        RELAY_BIN,
        &[
            ("OUTBOX_SCHEMA", db.schema.to_string()),
            ("OUTBOX_BROKER", "kafka".into()),
            ("OUTBOX_KAFKA_BROKERS", brokers.clone()),
            ("OUTBOX_CLOUDEVENTS", "true".into()),
            ("OUTBOX_CLOUDEVENTS_SOURCE", SOURCE.into()),
            ("OUTBOX_POLL_INTERVAL", "100ms".into()),
        ],
    );
    let reader = Reader::start(&reader_args(&[
        "kafka",
        &brokers,
        &topic,
        "3",
        &MESSAGES.to_string(),
        "120",
    ]))
    .await;
    let events = reader.collect().await;
    check_events(&events, &expected);
    relay.signal("TERM").await;
    relay.wait().await;
    db.cleanup().await;
}

/// The flag needs a source, and a source must be a URI reference: both are
/// refused at start-up with the flag named, before anything is published.
#[tokio::test]
async fn cloudevents_without_a_valid_source_is_refused_at_start_up() {
    let db = TestDb::new().await;
    let schema = db.schema.to_string();
    let (code, _, stderr) = cli(RELAY_BIN, &schema, &["run", "--cloudevents"]).await;
    assert_eq!(code, Some(2), "a usage error: {stderr}");
    assert!(stderr.contains("--cloudevents-source"), "{stderr}");
    let (code, _, stderr) = cli(
        RELAY_BIN,
        &schema,
        &[
            "run",
            "--cloudevents",
            "--cloudevents-source",
            "orders service",
        ],
    )
    .await;
    assert_eq!(code, Some(2), "a usage error: {stderr}");
    assert!(
        stderr.contains("--cloudevents-source") && stderr.contains("whitespace"),
        "{stderr}"
    );
    db.cleanup().await;
}
