//! Consumers written in another language (Python: pika, confluent-kafka) read
//! what the relay published and see the contract: message id present and
//! stable, nothing rolled back, per-key order, record key = ordering key.

use base64::Engine;
use outbox_tests::check::{check, Seen};
use outbox_tests::db::TestDb;
use outbox_tests::python::Reader;
use outbox_tests::workload::{self, Spec, Tag};
use outbox_tests::{fast_settings, kafka_brokers, InProcessRelay};
use tokio::process::Command;

const TMP: &str = env!("CARGO_TARGET_TMPDIR");
const MESSAGES: usize = 2_000;

fn consumer_script(name: &str) -> String {
    outbox_tests::python::script(name)
}

fn seen(values: &[serde_json::Value]) -> Vec<Seen> {
    values
        .iter()
        .map(|v| Seen {
            message_id: v["message_id"].as_str().unwrap_or_default().to_owned(),
            payload: base64::engine::general_purpose::STANDARD
                .decode(v["payload_b64"].as_str().unwrap_or_default())
                .expect("base64"),
        })
        .collect()
}

#[tokio::test]
async fn python_amqp_consumer_sees_the_contract() {
    let started = std::time::Instant::now();
    let db = TestDb::new().await;
    let exchange = outbox_tests::unique("py");
    outbox_tests::amqp::declare_unbound_exchange(&exchange).await;
    let child = Reader::start(&[
        consumer_script("amqp_consumer.py"),
        outbox_tests::amqp_url(),
        exchange.clone(),
        MESSAGES.to_string(),
        "120".into(),
    ])
    .await;
    let relay = InProcessRelay::amqp(&db, fast_settings());
    let written = workload::run(
        &db.config,
        &db.outbox(),
        &Spec::new(&exchange, 4, 20, MESSAGES),
    )
    .await;
    let got = child.collect().await;
    let report = check(&written, &seen(&got));
    outbox_tests::check::judge(TMP, "amqp: python consumer", &report, started, Some(0));
    for v in &got {
        assert_eq!(v["delivery_mode"], 2);
        assert_eq!(v["content_type"], "application/json");
        let headers = v["headers"].as_object().expect("headers");
        assert!(
            !headers.keys().any(|k| k.starts_with("ce-")),
            "no CloudEvents headers by default: {v}"
        );
    }
    relay.stop().await;
    outbox_tests::amqp::delete_exchange(&exchange).await;
    db.cleanup().await;
}

#[tokio::test]
async fn python_kafka_consumer_sees_the_contract() {
    let started = std::time::Instant::now();
    let db = TestDb::new().await;
    let brokers = kafka_brokers();
    let topic = outbox_tests::unique("py");
    outbox_tests::kafka::create_topic(&brokers, &topic, 4).await;
    let relay = InProcessRelay::kafka(&db, &brokers, &[], fast_settings());
    let written = workload::run(
        &db.config,
        &db.outbox(),
        &Spec::new(&topic, 4, 20, MESSAGES),
    )
    .await;
    let child = Reader::start(&[
        consumer_script("kafka_consumer.py"),
        brokers.clone(),
        topic.clone(),
        "4".into(),
        MESSAGES.to_string(),
        "120".into(),
    ])
    .await;
    let got = child.collect().await;
    let report = check(&written, &seen(&got));
    outbox_tests::check::judge(TMP, "kafka: python consumer", &report, started, None);
    for v in &got {
        let payload = base64::engine::general_purpose::STANDARD
            .decode(v["payload_b64"].as_str().unwrap_or_default())
            .expect("base64");
        let tag: Tag = serde_json::from_slice(&payload).expect("tag");
        assert_eq!(
            v["key"].as_str(),
            Some(tag.key.as_str()),
            "record key = ordering key"
        );
        assert_eq!(v["headers"]["content-type"], "application/json");
        let headers = v["headers"].as_object().expect("headers");
        assert!(
            !headers.keys().any(|k| k.starts_with("ce_")),
            "no CloudEvents headers by default: {v}"
        );
    }
    relay.stop().await;
    db.cleanup().await;
}

/// An app in Python (psycopg) enqueues with the SQL function
/// `outbox.enqueue(...)` and with a plain INSERT relying on the message id's
/// default; every invalid call fails with SQLSTATE 22023 and a message that
/// names the problem, writing nothing; what it enqueued reaches an
/// independent consumer (pika) like any other message.
#[tokio::test]
async fn python_enqueues_through_the_sql_function_and_a_plain_insert() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let exchange = outbox_tests::unique("sqlx");
    outbox_tests::amqp::declare_unbound_exchange(&exchange).await;
    let out = Command::new("python3")
        .arg(consumer_script("sql_producer.py"))
        .arg(outbox_tests::pg_url())
        .arg(db.schema.as_str())
        .arg(&exchange)
        .output()
        .await
        .expect("python3 runs (tests/run.sh installs psycopg)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.trim_end().ends_with("done"),
        "sql_producer.py failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect();
    let written: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| l.get("message_id").is_some())
        .collect();
    assert_eq!(written.len(), 25, "{stdout}");
    for refused in lines.iter().filter(|l| l.get("refused").is_some()) {
        assert_eq!(refused["sqlstate"], "22023", "{refused}");
        let message = refused["message"].as_str().unwrap_or("");
        assert!(message.starts_with("outbox: "), "{refused}");
    }
    let named = |what: &str| {
        lines
            .iter()
            .find(|l| l["refused"] == what)
            .and_then(|l| l["message"].as_str())
            .unwrap_or_default()
            .to_owned()
    };
    assert!(named("empty destination").contains("destination is empty"));
    assert!(named("reserved header").contains("\"Message-Id\""));
    assert!(named("header name with a space").contains("\"has space\""));
    assert!(named("non-string header value").contains("string value"));
    assert!(named("payload over the limit").contains("2000 bytes exceeds the limit of 1000"));
    assert!(named("empty event type").contains("event type is empty"));
    assert_eq!(
        lines.iter().filter(|l| l.get("refused").is_some()).count(),
        11
    );
    // Nothing refused or rolled back was written.
    assert_eq!(db.pending().await, 25);
    // The defaulted ids are UUIDv7: version 7, and time-ordered.
    let defaulted: Vec<uuid::Uuid> = written
        .iter()
        .filter(|l| l["how"] == "insert")
        .map(|l| {
            l["message_id"]
                .as_str()
                .unwrap_or("")
                .parse()
                .expect("uuid")
        })
        .collect();
    assert_eq!(defaulted.len(), 5);
    assert!(
        defaulted.iter().all(|u| u.get_version_num() == 7),
        "{defaulted:?}"
    );
    // The rows are exactly what outbox-client writes for the same message.
    let row = db
        .client
        .query_one(
            &format!(
                "SELECT routing_key, headers::text, content_type, ordering_key, event_type FROM {} \
                 WHERE message_id = $1",
                db.table()
            ),
            &[&written[0]["message_id"]
                .as_str()
                .unwrap_or("")
                .parse::<uuid::Uuid>()
                .expect("uuid")],
        )
        .await
        .expect("row");
    assert_eq!(row.get::<_, String>(0), "orders.paid");
    assert_eq!(row.get::<_, String>(1), r#"{"tenant": "acme"}"#);
    assert_eq!(
        row.get::<_, Option<String>>(2).as_deref(),
        Some("application/json")
    );
    assert_eq!(row.get::<_, Option<String>>(3).as_deref(), Some("order-0"));
    assert_eq!(
        row.get::<_, Option<String>>(4).as_deref(),
        Some("com.example.order.paid")
    );

    // Delivered end to end to an independent consumer.
    let consumer = Reader::start(&[
        consumer_script("amqp_consumer.py"),
        outbox_tests::amqp_url(),
        exchange.clone(),
        "25".into(),
        "60".into(),
    ])
    .await;
    let relay = InProcessRelay::amqp(&db, fast_settings());
    let got = consumer.collect().await;
    relay.stop().await;
    let ids: std::collections::HashSet<&str> = got
        .iter()
        .filter_map(|d| d["message_id"].as_str())
        .collect();
    for w in &written {
        assert!(
            ids.contains(w["message_id"].as_str().unwrap_or("")),
            "{w} was not delivered"
        );
    }
    outbox_tests::amqp::delete_exchange(&exchange).await;
    db.cleanup().await;
}
