//! Messages refused before or while sending (by the client library, over the
//! broker's size limit, a backlog of large Kafka records): a refusal holds back
//! its key, fails alone and never turns into an endless outage.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, SystemTime};

use outbox_client::{Message, MessageBuilder};
use outbox_relay::publish::amqp::{AmqpPublisher, AmqpSettings};
use outbox_relay::publish::{Envelope, Publisher};
use outbox_tests::amqp::{self, Fixture};
use outbox_tests::db::TestDb;
use outbox_tests::{eventually, fast_settings, InProcessRelay};

use super::PATIENCE;

/// A message the client library refuses to hand to the broker (AMQP caps a
/// content type at 255 bytes) must hold back its key like a broker refusal:
/// before the fix the loop published the key's next message in the same
/// wave, so it overtook the refused one.
#[tokio::test]
async fn a_message_refused_before_sending_holds_back_its_key() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let messages = (0..20)
        .map(|i| {
            let mut b = Message::builder(rabbit.exchange.as_str())
                .key("k")
                .payload(format!("{i}").into_bytes());
            if i == 5 {
                b = b.content_type(format!("text/{}", "x".repeat(300)));
            }
            b.build().expect("valid")
        })
        .collect();
    let relay = only_messages_before_the_refused_one_go_out(
        &db,
        messages,
        |settings| InProcessRelay::amqp(&db, settings),
        || rabbit.deliveries().into_iter().map(|d| d.payload).collect(),
    )
    .await;
    relay.stop().await;
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// Enqueues `messages` (one key, payloads "0".."19", the sixth refused by
/// the client library before sending), starts the relay with parking on,
/// and checks that the refused one is dead-lettered and that only the five
/// before it arrive. Returns the relay to stop.
async fn only_messages_before_the_refused_one_go_out(
    db: &TestDb,
    messages: Vec<Message>,
    start: impl FnOnce(outbox_relay::Settings) -> InProcessRelay,
    delivered: impl Fn() -> Vec<Vec<u8>>,
) -> InProcessRelay {
    db.outbox()
        .max_payload_bytes(4 * 1024 * 1024)
        .enqueue_batch(&db.client, &messages)
        .await
        .expect("enqueue");
    let relay = start(outbox_relay::Settings {
        park_on_dead_letter: true,
        ..fast_settings()
    });
    assert!(
        eventually(PATIENCE, || async { db.count("dead_letters").await == 1 }).await,
        "the refused message was not dead-lettered"
    );
    // The five were confirmed before the sixth was refused, not
    // necessarily read yet; then a second for any that should not come.
    assert!(
        eventually(PATIENCE, || async { delivered().len() >= 5 }).await,
        "the five messages before the refused one did not all arrive"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let got: Vec<String> = delivered()
        .iter()
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .collect();
    assert_eq!(
        got,
        (0..5).map(|i| i.to_string()).collect::<Vec<_>>(),
        "only the messages before the refused one may go out"
    );
    relay
}

/// How many times each payload arrived, once the consumer has at least `n`
/// deliveries: a drained outbox says the broker confirmed every message,
/// not that the consumer has read them yet.
async fn tally(rabbit: &Fixture, n: usize) -> HashMap<Vec<u8>, usize> {
    rabbit.expect_at_least(n, Duration::from_secs(30)).await;
    let mut seen = HashMap::new();
    for d in rabbit.deliveries() {
        *seen.entry(d.payload).or_default() += 1;
    }
    seen
}

/// RabbitMQ's `max_message_size` is one setting for the whole broker: the
/// tests that lower it take turns.
static SIZE_LIMIT: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Lowers RabbitMQ's `max_message_size` to 1 MiB for as long as it is held;
/// [`LowLimit::restore`] puts the default back.
struct LowLimit {
    _turn: tokio::sync::MutexGuard<'static, ()>,
}

impl LowLimit {
    async fn set() -> LowLimit {
        let guard = SIZE_LIMIT.lock().await;
        amqp::set_max_message_size(1024 * 1024).await;
        LowLimit { _turn: guard }
    }

    async fn restore(self) {
        amqp::set_max_message_size(128 * 1024 * 1024).await;
    }
}

/// The broker closes the channel for a message over its limit while the
/// publisher is still handing it the rest of the batch, so the publishes
/// after the close fail with a bare "channel closed" and only the confirms
/// already handed over carry the broker's reason. Before the fix the
/// publisher gave up at the first failed publish without reading them,
/// never learned the limit, and sent the message again on every retry: an
/// outage without end, which CI saw once in the relay-level test below.
#[tokio::test]
async fn the_size_limit_is_learned_when_the_channel_closes_mid_batch() {
    outbox_tests::init_logging();
    let rabbit = Fixture::new().await;
    let limit = LowLimit::set().await;
    let publisher = AmqpPublisher::new(AmqpSettings {
        url: outbox_tests::amqp_url(),
        confirm_timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(5),
        ca_pem: None,
    });
    let envelope = |seq: i64, payload: Vec<u8>| Envelope {
        seq,
        message_id: uuid::Uuid::now_v7(),
        destination: rabbit.exchange.clone(),
        ordering_key: Some(format!("k{}", seq % 7)),
        routing_key: String::new(),
        headers: Vec::new(),
        payload,
        content_type: None,
        event_type: None,
        created_at: SystemTime::now(),
        attempts: 0,
    };
    // The oversized message first, then enough small ones that the close
    // arrives while they are still being handed over.
    let mut batch = vec![envelope(0, vec![b'z'; 2 * 1024 * 1024])];
    batch.extend((1..20_000).map(|seq| envelope(seq, seq.to_be_bytes().to_vec())));
    let first = publisher.publish(&batch).await;
    let again = publisher.publish(&batch[..1]).await;
    limit.restore().await;
    assert!(
        !matches!(&first, Ok(v) if v.iter().all(Result::is_ok)),
        "the broker accepted a message over its limit"
    );
    match again {
        Ok(verdicts) => assert!(
            matches!(&verdicts[0], Err(r) if r.permanent),
            "the oversized message was not refused as permanent: {verdicts:?}"
        ),
        Err(e) => panic!("the limit was not learned from the first batch; sent again: {e:#}"),
    }
    publisher.close().await;
    rabbit.cleanup().await;
}

/// 200 messages of 4 bytes over 7 keys for `exchange`, the 51st made too
/// large by `oversize`.
fn two_hundred_with_one_too_large(
    exchange: &str,
    oversize: impl Fn(MessageBuilder) -> MessageBuilder,
) -> Vec<Message> {
    (0..200u32)
        .map(|i| {
            let b = Message::builder(exchange)
                .key(format!("k{}", i % 7))
                .payload(i.to_be_bytes().to_vec());
            let b = if i == 50 { oversize(b) } else { b };
            b.build().expect("valid")
        })
        .collect()
}

/// Starts a relay that does not park keys and waits up to a minute for the
/// outbox to empty; returns the relay and whether it emptied.
async fn drain_without_parking(db: &TestDb) -> (InProcessRelay, bool) {
    let relay = InProcessRelay::amqp(
        db,
        outbox_relay::Settings {
            park_on_dead_letter: false,
            ..fast_settings()
        },
    );
    let drained = eventually(Duration::from_secs(60), || async {
        db.pending().await == 0
    })
    .await;
    (relay, drained)
}

/// A message over the broker's `max_message_size` closes the channel under
/// the whole batch. Before the fix that was an outage forever: the rest of
/// the batch repeated and the message was never dead-lettered. It must fail
/// alone, go to the dead letters, and let everything else through.
#[tokio::test]
async fn a_message_over_the_brokers_size_limit_fails_alone() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let limit = LowLimit::set().await;
    let msgs = two_hundred_with_one_too_large(&rabbit.exchange, |b| {
        b.payload(vec![b'z'; 2 * 1024 * 1024])
    });
    db.outbox()
        .max_payload_bytes(4 * 1024 * 1024)
        .enqueue_batch(&db.client, &msgs)
        .await
        .expect("enqueue");
    let (relay, drained) = drain_without_parking(&db).await;
    limit.restore().await;
    assert!(
        drained,
        "the outbox never drained past the oversized message"
    );
    assert_eq!(db.count("dead_letters").await, 1);
    let seen = tally(&rabbit, 199).await;
    assert_eq!(seen.len(), 199, "every other message arrives");
    relay.stop().await;
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// A message's properties and headers travel in one AMQP frame, which may
/// not exceed the frame size the connection negotiated (128 KiB on RabbitMQ
/// by default); only the body is split across frames. RabbitMQ closes the
/// connection on a larger one (FRAME_ERROR, frame_too_large). Before the
/// fix a row with 300 KiB of headers did that on every attempt, each
/// counted as an outage: nothing was published, by any key, and the row was
/// never dead-lettered. It must fail alone, go to the dead letters with its
/// reason, and let everything else through, each message once.
#[tokio::test]
async fn headers_larger_than_a_frame_fail_alone() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let msgs = two_hundred_with_one_too_large(&rabbit.exchange, |b| {
        b.header("big", "x".repeat(300 * 1024))
    });
    db.outbox()
        .enqueue_batch(&db.client, &msgs)
        .await
        .expect("enqueue");
    let (relay, drained) = drain_without_parking(&db).await;
    assert!(
        drained,
        "the outbox never drained past the oversized headers"
    );
    let reasons: Vec<String> = db
        .column(&format!(
            "SELECT last_error FROM {}.dead_letters",
            db.schema.quoted()
        ))
        .await;
    assert_eq!(reasons.len(), 1, "{reasons:?}");
    assert!(
        reasons[0].contains("frame size"),
        "the reason names the frame size: {reasons:?}"
    );
    let seen = tally(&rabbit, 199).await;
    assert_eq!(seen.len(), 199, "every other message arrives");
    assert!(seen.values().all(|n| *n == 1), "each once: {seen:?}");
    relay.stop().await;
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// Kafka: a record librdkafka refuses locally (over `message.max.bytes`)
/// holds back its key like a broker refusal. Before the fix the loop queued
/// the key's next records in the same batch, which overtook it.
#[tokio::test]
async fn kafka_a_record_refused_before_sending_holds_back_its_key() {
    outbox_tests::init_logging();
    let brokers = outbox_tests::kafka_brokers();
    let kafka = outbox_tests::kafka::Fixture::new(&brokers, 1).await;
    let db = TestDb::new().await;
    let messages = (0..20)
        .map(|i| {
            let payload = if i == 5 {
                vec![b'z'; 2 * 1024 * 1024]
            } else {
                format!("{i}").into_bytes()
            };
            Message::builder(kafka.topic.as_str())
                .key("k")
                .payload(payload)
                .build()
                .expect("valid")
        })
        .collect();
    let relay = only_messages_before_the_refused_one_go_out(
        &db,
        messages,
        |settings| InProcessRelay::kafka(&db, &brokers, &[], settings),
        || kafka.records().into_iter().map(|r| r.payload).collect(),
    )
    .await;
    relay.stop().await;
    kafka.stop().await;
    db.cleanup().await;
}

/// Kafka: 520 rows of 140 KB (73 MB, past librdkafka's 64 MiB local queue
/// when claimed as one batch). Before the fix the batch failed as an outage
/// after part of it was sent, and outages never count as attempts, so the
/// same rows repeated without end. A batch is now bounded by bytes as well,
/// so it always fits; and the largest payload the client accepts by default
/// goes through librdkafka's default limits.
#[tokio::test]
async fn kafka_a_backlog_of_large_records_drains_without_repeats() {
    outbox_tests::init_logging();
    let brokers = outbox_tests::kafka_brokers();
    let kafka = outbox_tests::kafka::Fixture::new(&brokers, 4).await;
    let db = TestDb::new().await;
    let outbox = db.outbox();
    let mut expected = HashSet::new();
    for chunk in 0..13 {
        let msgs: Vec<Message> = (0..40)
            .map(|i| {
                Message::builder(kafka.topic.as_str())
                    .key(format!("k{}", i % 9))
                    .payload(vec![b'a' + (chunk % 26) as u8; 140_000])
                    .build()
                    .expect("valid")
            })
            .collect();
        for id in outbox
            .enqueue_batch(&db.client, &msgs)
            .await
            .expect("enqueue")
        {
            expected.insert(id.to_string());
        }
    }
    // The client's own default limit, with a key and a header beside it.
    let biggest = Message::builder(kafka.topic.as_str())
        .key("k-biggest")
        .header("tenant", "t".repeat(200))
        .payload(vec![b'b'; outbox_client::DEFAULT_MAX_PAYLOAD_BYTES])
        .build()
        .expect("valid");
    expected.insert(
        outbox
            .enqueue(&db.client, &biggest)
            .await
            .expect("the default limit is accepted")
            .to_string(),
    );
    let relay = InProcessRelay::kafka(&db, &brokers, &[], fast_settings());
    assert!(
        eventually(PATIENCE, || async { db.pending().await == 0 }).await,
        "{} rows left in the outbox",
        db.pending().await
    );
    assert_eq!(db.count("dead_letters").await, 0, "nothing is refused");
    assert!(
        eventually(Duration::from_secs(60), || async {
            kafka.count() >= expected.len()
        })
        .await,
        "{} of {} records consumed",
        kafka.count(),
        expected.len()
    );
    let failures = relay
        .stats
        .counted(outbox_relay::health::Event::BatchFailed);
    assert_eq!(failures, 0, "no batch failed as a whole");
    let mut seen: HashMap<String, usize> = HashMap::new();
    for r in kafka.records() {
        *seen
            .entry(r.headers.get("message-id").cloned().unwrap_or_default())
            .or_default() += 1;
    }
    assert!(
        expected.iter().all(|id| seen.get(id) == Some(&1)),
        "each record once"
    );
    relay.stop().await;
    kafka.stop().await;
    db.cleanup().await;
}
