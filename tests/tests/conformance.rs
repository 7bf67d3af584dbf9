//! One conformance suite for every broker behind the `Publisher` boundary:
//! success with the header and id contract and per-key order, broker down,
//! broker back, and a permanent rejection. Each broker is reached through a TCP
//! proxy so "down" is real network failure, not a mock.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use outbox_relay::publish::amqp::{AmqpPublisher, AmqpSettings};
use outbox_relay::publish::kafka::{KafkaPublisher, KafkaSettings};
use outbox_relay::publish::{Envelope, Publisher};
use outbox_tests::eventually;
use outbox_tests::process::Tansu;
use outbox_tests::proxy::{Mode, Proxy};

const PATIENCE: Duration = Duration::from_secs(120);

/// A message as the independent consumer saw it: id, headers, payload.
type Seen = (String, HashMap<String, String>, Vec<u8>);

/// What the suite needs from a broker.
trait Broker {
    type P: Publisher;
    /// The publisher under test, connected through the proxy.
    fn publisher(&self) -> &Self::P;
    fn proxy(&self) -> &Proxy;
    /// A destination an independent consumer is reading.
    fn destination(&self) -> &str;
    /// What the consumer has received: (message id, headers, payload), in order.
    fn received(&self) -> Vec<Seen>;
    /// An envelope this broker can never accept.
    fn impossible(&self, seq: i64) -> Envelope;
}

fn envelope(seq: i64, destination: &str, key: &str) -> Envelope {
    Envelope {
        seq,
        message_id: uuid::Uuid::now_v7(),
        destination: destination.to_owned(),
        ordering_key: Some(key.to_owned()),
        routing_key: format!("rk.{key}"),
        headers: vec![("tenant".into(), "acme".into())],
        payload: format!("{key}:{seq}").into_bytes(),
        content_type: Some("text/plain".into()),
        event_type: None,
        created_at: SystemTime::now(),
        attempts: 0,
    }
}

async fn suite<B: Broker>(b: &B) {
    // Success: every message confirmed, contract on the wire, per-key order.
    let batch: Vec<Envelope> = (0..60)
        .map(|i| envelope(i, b.destination(), if i % 2 == 0 { "a" } else { "b" }))
        .collect();
    let outcomes = b.publisher().publish(&batch).await.expect("broker up");
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    assert!(
        eventually(PATIENCE, || async { b.received().len() >= 60 }).await,
        "not consumed"
    );
    let got = b.received();
    let by_id: HashMap<&str, &Seen> = got.iter().map(|r| (r.0.as_str(), r)).collect();
    for env in &batch {
        let r = by_id
            .get(env.message_id.to_string().as_str())
            .expect("every id arrives");
        assert_eq!(r.2, env.payload, "payload passes through untouched");
        assert_eq!(
            r.1.get("tenant").map(String::as_str),
            Some("acme"),
            "row headers forwarded"
        );
    }
    for key in ["a", "b"] {
        let order: Vec<Vec<u8>> = got
            .iter()
            .filter(|r| r.2.starts_with(format!("{key}:").as_bytes()))
            .map(|r| r.2.clone())
            .collect();
        let expected: Vec<Vec<u8>> = batch
            .iter()
            .filter(|e| e.ordering_key.as_deref() == Some(key))
            .map(|e| e.payload.clone())
            .collect();
        assert_eq!(order, expected, "key {key} out of order");
    }

    // A permanent rejection fails that message only.
    let mixed = vec![
        envelope(100, b.destination(), "c"),
        b.impossible(101),
        envelope(102, b.destination(), "d"),
    ];
    let outcomes = b.publisher().publish(&mixed).await.expect("broker up");
    assert!(outcomes[0].is_ok() && outcomes[2].is_ok(), "{outcomes:?}");
    match &outcomes[1] {
        Err(r) => assert!(r.permanent, "{r:?}"),
        Ok(_) => panic!("an impossible message was accepted"),
    }

    // Broker down: the batch fails as a whole (an outage, not the messages' fault).
    b.proxy().set(Mode::Refuse);
    let down = vec![envelope(200, b.destination(), "e")];
    assert!(
        b.publisher().publish(&down).await.is_err(),
        "published while the broker was unreachable"
    );

    // Broker back: publishing works again without a new publisher.
    b.proxy().set(Mode::Pass);
    let mut back = false;
    for _ in 0..60 {
        if matches!(b.publisher().publish(&down).await, Ok(o) if o.iter().all(Result::is_ok)) {
            back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        back,
        "the publisher never recovered after the broker came back"
    );
    let id = down[0].message_id.to_string();
    assert!(
        eventually(PATIENCE, || async {
            b.received().iter().any(|r| r.0 == id)
        })
        .await,
        "the message published after recovery never arrived"
    );
    b.publisher().close().await;
}

struct Rabbit {
    publisher: AmqpPublisher,
    proxy: Proxy,
    fixture: outbox_tests::amqp::Fixture,
}

impl Broker for Rabbit {
    type P = AmqpPublisher;
    fn publisher(&self) -> &AmqpPublisher {
        &self.publisher
    }
    fn proxy(&self) -> &Proxy {
        &self.proxy
    }
    fn destination(&self) -> &str {
        &self.fixture.exchange
    }
    fn received(&self) -> Vec<Seen> {
        self.fixture
            .deliveries()
            .into_iter()
            .map(|d| {
                let mut h: HashMap<String, String> = d.headers.into_iter().collect();
                if let Some(ct) = d.content_type {
                    h.insert("content-type".into(), ct);
                }
                (d.message_id, h, d.payload)
            })
            .collect()
    }
    fn impossible(&self, seq: i64) -> Envelope {
        // AMQP header names are short strings: at most 255 bytes.
        let mut e = envelope(seq, &self.fixture.exchange, "x");
        e.headers.push(("h".repeat(300), "v".into()));
        e
    }
}

#[tokio::test]
async fn amqp_conforms() {
    outbox_tests::init_logging();
    let proxy = Proxy::start("127.0.0.1:5672").await;
    let rabbit = Rabbit {
        publisher: AmqpPublisher::new(AmqpSettings {
            url: format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port),
            confirm_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            ca_pem: None,
        }),
        proxy,
        fixture: outbox_tests::amqp::Fixture::new().await,
    };
    suite(&rabbit).await;
    rabbit.fixture.cleanup().await;
}

struct Kafka {
    publisher: KafkaPublisher,
    proxy: Proxy,
    fixture: outbox_tests::kafka::Fixture,
    _tansu: Tansu,
}

impl Broker for Kafka {
    type P = KafkaPublisher;
    fn publisher(&self) -> &KafkaPublisher {
        &self.publisher
    }
    fn proxy(&self) -> &Proxy {
        &self.proxy
    }
    fn destination(&self) -> &str {
        &self.fixture.topic
    }
    fn received(&self) -> Vec<Seen> {
        self.fixture
            .records()
            .into_iter()
            .map(|r| {
                let h: HashMap<String, String> = r.headers.into_iter().collect();
                (
                    h.get("message-id").cloned().unwrap_or_default(),
                    h,
                    r.payload,
                )
            })
            .collect()
    }
    fn impossible(&self, seq: i64) -> Envelope {
        // Larger than the producer's message.max.bytes (1 MB by default).
        let mut e = envelope(seq, &self.fixture.topic, "x");
        e.payload = vec![0u8; 2 << 20];
        e
    }
}

#[tokio::test]
async fn kafka_conforms() {
    outbox_tests::init_logging();
    // A private broker that advertises the proxy, so every connection goes
    // through it (see kafka_e2e's outage test).
    let (tansu, proxy, brokers) = outbox_tests::process::tansu_behind_proxy().await;
    let kafka = Kafka {
        publisher: KafkaPublisher::new(KafkaSettings {
            brokers: brokers.clone(),
            properties: vec![],
            message_timeout: Duration::from_secs(3),
            in_flight: Default::default(),
        })
        .expect("producer"),
        proxy,
        fixture: outbox_tests::kafka::Fixture::new(&brokers, 2).await,
        _tansu: tansu,
    };
    suite(&kafka).await;
}
