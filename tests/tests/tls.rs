//! TLS with verification, to Postgres, RabbitMQ and Kafka.
//!
//! Each service sits behind a TLS-terminating proxy whose certificate comes
//! from a CA made for the run. The relay must trust that CA when told to, and
//! must refuse the connection when it trusts only another one.

use std::time::Duration;

use outbox_client::Message;
use outbox_relay::publish::amqp::{AmqpPublisher, AmqpSettings};
use outbox_relay::publish::kafka::{KafkaPublisher, KafkaSettings};
use outbox_relay::publish::Publisher;
use outbox_relay::source::Database;
use outbox_tests::db::TestDb;
use outbox_tests::process::Tansu;
use outbox_tests::tls::{Handshake, Pki, TlsProxy};
use outbox_tests::{eventually, fast_settings, InProcessRelay};
use tokio::process::Command;

const RELAY_BIN: &str = env!("CARGO_BIN_EXE_outbox-relay-under-test");
const PATIENCE: Duration = Duration::from_secs(60);

fn messages(destination: &str, n: i32) -> Vec<Message> {
    (0..n)
        .map(|i| {
            Message::builder(destination)
                .key(format!("k{}", i % 7))
                .json(&i)
                .build()
                .expect("valid")
        })
        .collect()
}

/// Enqueues 200 messages to `destination` and waits until `delivered` has
/// counted them all.
async fn deliver_200(db: &TestDb, destination: &str, delivered: impl Fn() -> usize, how: &str) {
    db.outbox()
        .enqueue_batch(&db.client, &messages(destination, 200))
        .await
        .expect("enqueue");
    assert!(
        eventually(PATIENCE, || async { delivered() >= 200 }).await,
        "delivered {} of 200 {how}",
        delivered()
    );
}

/// host:port of the test database, for the proxy's upstream.
fn tls_url(db: &TestDb, port: u16, ca: &std::path::Path) -> String {
    format!(
        "postgres://{}@localhost:{port}/{}?sslmode=verify-full&sslrootcert={}",
        db.config.get_user().unwrap_or("postgres"),
        db.config.get_dbname().unwrap_or("postgres"),
        ca.display()
    )
}

/// `outbox-relay status` against `url`: (exit code, stderr).
async fn status(db: &TestDb, url: &str) -> (i32, String) {
    let out = Command::new(RELAY_BIN)
        .args(["status"])
        .env("OUTBOX_DATABASE_URL", url)
        .env("OUTBOX_SCHEMA", db.schema.as_str())
        .output()
        .await
        .expect("run status");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn postgres_over_verified_tls_and_an_unknown_ca_is_refused() {
    outbox_tests::init_logging();
    let pki = Pki::new();
    let db = TestDb::new().await;
    let proxy = TlsProxy::start(&pki, Handshake::Postgres, &db.address()).await;
    let rabbit = outbox_tests::amqp::Fixture::new().await;

    // The operator CLI and the relay both reach Postgres only through TLS.
    let good = tls_url(&db, proxy.port, &pki.ca_file);
    // It connects and reads the schema: its only complaint is that no relay
    // runs yet (exit 1 after the report).
    let (code, err) = status(&db, &good).await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("no relay replica is running"), "{err}");
    let database = Database::from_url(&good).expect("url");
    assert!(database.tls());
    let relay = InProcessRelay::on(
        database,
        &db,
        AmqpPublisher::new(AmqpSettings {
            url: outbox_tests::amqp_url(),
            confirm_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            ca_pem: None,
        }),
        fast_settings(),
    );
    deliver_200(
        &db,
        &rabbit.exchange,
        || rabbit.count(),
        "with postgres over tls",
    )
    .await;
    relay.stop().await;
    assert!(
        proxy.handshakes() >= 3,
        "claims, LISTEN and ownership each need a TLS session: {}",
        proxy.handshakes()
    );

    // Trusting only another CA: refused, saying why.
    let before = proxy.handshakes();
    let (code, err) = status(&db, &tls_url(&db, proxy.port, &pki.other_ca_file)).await;
    assert_ne!(code, 0);
    assert!(err.to_lowercase().contains("certificate"), "{err}");
    assert!(!err.contains("no relay replica"), "{err}");
    // A missing root file is a configuration error naming the flag.
    let (code, err) = status(
        &db,
        &tls_url(&db, proxy.port, std::path::Path::new("/nonexistent/ca.pem")),
    )
    .await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("sslrootcert"), "{err}");
    assert_eq!(proxy.handshakes(), before, "no session may complete");
    proxy.stop();
    rabbit.cleanup().await;
    db.cleanup().await;
}

#[tokio::test]
async fn amqps_with_peer_verification() {
    outbox_tests::init_logging();
    let pki = Pki::new();
    let proxy = TlsProxy::start(&pki, Handshake::Direct, "127.0.0.1:5672").await;
    let url = format!("amqps://guest:guest@localhost:{}/%2f", proxy.port);
    let amqps = |ca: &std::path::Path| AmqpSettings {
        url: url.clone(),
        confirm_timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(5),
        ca_pem: Some(std::fs::read_to_string(ca).expect("ca")),
    };

    // Trusting another CA (or only the system's): no connection.
    let refused = AmqpPublisher::new(amqps(&pki.other_ca_file)).ready().await;
    let err = refused
        .expect_err("an unknown CA must be refused")
        .to_string();
    assert!(err.contains("cannot connect"), "{err}");
    let system_only = AmqpPublisher::new(AmqpSettings {
        ca_pem: None,
        ..amqps(&pki.ca_file)
    });
    assert!(system_only.ready().await.is_err());
    assert_eq!(proxy.handshakes(), 0);

    // Trusting the right CA: the relay delivers everything over amqps.
    let db = TestDb::new().await;
    let rabbit = outbox_tests::amqp::Fixture::new().await;
    let relay = InProcessRelay::with(
        &db,
        AmqpPublisher::new(amqps(&pki.ca_file)),
        fast_settings(),
    );
    deliver_200(&db, &rabbit.exchange, || rabbit.count(), "over amqps").await;
    relay.stop().await;
    assert!(proxy.handshakes() >= 1);
    proxy.stop();
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// Kafka's SSL through the pass-through properties: a private tansu that
/// advertises the TLS proxy's port, so every connection crosses TLS.
#[tokio::test]
async fn kafka_ssl_through_pass_through_properties() {
    outbox_tests::init_logging();
    let pki = Pki::new();
    let proxy_listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let proxy_port = proxy_listener.local_addr().expect("addr").port();
    let broker_port = outbox_tests::free_port();
    let tansu = Tansu::start(broker_port, proxy_port);
    let proxy = TlsProxy::start_on(
        &pki,
        Handshake::Direct,
        proxy_listener,
        &format!("127.0.0.1:{broker_port}"),
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            tokio::net::TcpStream::connect(("127.0.0.1", broker_port))
                .await
                .is_ok()
        })
        .await,
        "private tansu did not start"
    );
    let brokers = format!("localhost:{proxy_port}");
    let ca = pki.ca_file.to_string_lossy().into_owned();
    let ssl = [
        ("security.protocol", "ssl"),
        ("ssl.ca.location", ca.as_str()),
        ("ssl.endpoint.identification.algorithm", "https"),
    ];
    let topic = outbox_tests::kafka::Fixture::new_with(&brokers, &ssl, 2).await;

    // Trusting another CA: the producer cannot deliver.
    let other = pki.other_ca_file.to_string_lossy().into_owned();
    let wrong = KafkaPublisher::new(KafkaSettings {
        brokers: brokers.clone(),
        properties: vec![
            ("security.protocol".into(), "ssl".into()),
            ("ssl.ca.location".into(), other),
        ],
        message_timeout: Duration::from_secs(3),
        in_flight: Default::default(),
    })
    .expect("producer");
    assert!(
        wrong.ready().await.is_err(),
        "an unknown CA must be refused"
    );
    wrong.close().await;

    let db = TestDb::new().await;
    let relay = InProcessRelay::kafka(&db, &brokers, &ssl, fast_settings());
    deliver_200(&db, &topic.topic, || topic.count(), "over kafka ssl").await;
    relay.stop().await;
    assert!(proxy.handshakes() >= 2, "producer and consumer sessions");
    topic.stop().await;
    proxy.stop();
    tansu.stop().await;
    db.cleanup().await;
}
