//! The Kafka consumer helper: a crash between the effect's commit and the
//! offset commit is recognized by the group's next consumer, and a record
//! whose id cannot be recorded does not hold the partition.

use std::time::Duration;

use outbox_client::consumer::{apply_once, Handler};
use outbox_client::inbox::{Arrival, Inbox};
use outbox_tests::db::{connect, TestDb};
use outbox_tests::unique;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::{Offset, TopicPartitionList};
use tokio_postgres::Transaction;

use super::{applied, apply_effect, create_effects, PATIENCE};

struct CountRecord {
    table: String,
}

impl<'a> Handler<rdkafka::message::BorrowedMessage<'a>> for CountRecord {
    type Error = tokio_postgres::Error;
    async fn handle(
        &self,
        tx: &Transaction<'_>,
        m: &rdkafka::message::BorrowedMessage<'a>,
    ) -> Result<(), Self::Error> {
        use rdkafka::Message as _;
        let message = String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned();
        apply_effect(tx, &self.table, &message).await
    }
}

/// Produces `records`, each a payload and its `message-id` header, to
/// `topic` (one partition) with key "k", in order.
async fn produce_with_ids(brokers: &str, topic: &str, records: &[(&str, &str)]) {
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("producer");
    for (payload, id) in records {
        producer
            .send(
                FutureRecord::to(topic).payload(*payload).key("k").headers(
                    OwnedHeaders::new().insert(Header {
                        key: "message-id",
                        value: Some(*id),
                    }),
                ),
                Duration::from_secs(30),
            )
            .await
            .map_err(|(e, _)| e)
            .expect("produce");
    }
}

/// A consumer of `group` without auto-commit, assigned partition 0 of
/// `topic` from the group's stored offset (the earliest without one).
fn assigned_consumer(brokers: &str, topic: &str, group: &str) -> StreamConsumer {
    let c: StreamConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Stored)
        .expect("partition");
    c.assign(&tpl).expect("assign");
    c
}

/// Kafka: a consumer commits its effect and dies before committing the offset;
/// the next consumer of the group reads the record again, recognizes it and
/// commits the offset, and the effect is not repeated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_crash_between_commit_and_offset_commit_is_recognized() {
    use outbox_client::consumer::kafka::KafkaInbox;

    let brokers = outbox_tests::kafka_brokers();
    let db = TestDb::new().await;
    let effects = create_effects(&db).await;
    let topic = unique("t");
    outbox_tests::kafka::create_topic(&brokers, &topic, 1).await;
    let message_id = uuid::Uuid::now_v7().to_string();
    produce_with_ids(&brokers, &topic, &[("k-crash", &message_id)]).await;
    let group = unique("g");
    let new_consumer = || assigned_consumer(&brokers, &topic, &group);
    let inbox = Inbox::with_schema(db.schema.clone());
    let handler = CountRecord {
        table: effects.clone(),
    };

    {
        let first = new_consumer();
        let mut client = connect(&db.config).await;
        let record = tokio::time::timeout(PATIENCE, first.recv())
            .await
            .expect("record in time")
            .expect("record");
        let outcome = apply_once(
            &mut client,
            &inbox,
            "counter",
            &message_id,
            &record,
            &handler,
        )
        .await
        .expect("applied");
        assert_eq!(outcome, Arrival::New);
        // Dropped without committing the offset.
    }
    assert_eq!(applied(&db, &effects, "k-crash").await, 1);

    let second = new_consumer();
    let mut client = connect(&db.config).await;
    let record = tokio::time::timeout(PATIENCE, second.recv())
        .await
        .expect("record again in time")
        .expect("record");
    let consumer = KafkaInbox::new(inbox, "counter").expect("consumer");
    let outcome = consumer
        .handle(&mut client, &second, &record, &handler)
        .await
        .expect("handled");
    assert_eq!(outcome, Arrival::Duplicate);
    assert_eq!(applied(&db, &effects, "k-crash").await, 1);
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(&topic, 0);
    let committed =
        tokio::task::block_in_place(|| second.committed_offsets(tpl, Duration::from_secs(30)))
            .expect("committed offsets");
    assert_eq!(
        committed.find_partition(&topic, 0).map(|p| p.offset()),
        Some(Offset::Offset(1)),
        "offset committed past the duplicate"
    );
    db.cleanup().await;
}

/// Kafka carries the message id in a header of any length. An id the inbox
/// cannot record (3,000 bytes, over its 512-byte keys) failed the inbox
/// insert on every read: the consumer sought back to it and read it again,
/// forever, and the partition behind it never moved. It is now unusable like
/// a missing id, settled by the missing-id policy (here: skipped), and the
/// next record is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_an_id_too_long_to_record_is_settled_like_a_missing_one() {
    use outbox_client::consumer::kafka::{KafkaInbox, MissingIdPolicy};
    use outbox_client::consumer::ConsumeError;

    let brokers = outbox_tests::kafka_brokers();
    let db = TestDb::new().await;
    let effects = create_effects(&db).await;
    let topic = unique("t");
    outbox_tests::kafka::create_topic(&brokers, &topic, 1).await;
    let long_id = outbox_tests::random_hex(3_000);
    let fine_id = uuid::Uuid::now_v7().to_string();
    produce_with_ids(
        &brokers,
        &topic,
        &[("too-long", &long_id), ("fine", &fine_id)],
    )
    .await;
    let consumer = assigned_consumer(&brokers, &topic, &unique("g"));
    let inbox = KafkaInbox::new(Inbox::with_schema(db.schema.clone()), "counter")
        .expect("consumer")
        .missing_id(MissingIdPolicy::Skip);
    let handler = CountRecord {
        table: effects.clone(),
    };
    let mut client = connect(&db.config).await;
    let mut outcomes = Vec::new();
    for _ in 0..2 {
        let record = tokio::time::timeout(PATIENCE, consumer.recv())
            .await
            .expect("record in time")
            .expect("record");
        let payload = {
            use rdkafka::Message as _;
            String::from_utf8_lossy(record.payload().unwrap_or_default()).into_owned()
        };
        let outcome = inbox
            .handle(&mut client, &consumer, &record, &handler)
            .await;
        outcomes.push((payload, outcome));
    }
    assert!(
        matches!(
            &outcomes[0],
            (p, Err(ConsumeError::MissingMessageId)) if p == "too-long"
        ),
        "{outcomes:?}"
    );
    assert!(
        matches!(&outcomes[1], (p, Ok(Arrival::New)) if p == "fine"),
        "the next record is read and applied: {outcomes:?}"
    );
    assert_eq!(applied(&db, &effects, "fine").await, 1);
    assert_eq!(applied(&db, &effects, "too-long").await, 0);
    db.cleanup().await;
}
