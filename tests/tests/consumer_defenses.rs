//! Consumer-side defenses against duplicate runs, against real Postgres,
//! RabbitMQ and (for the Kafka test) a Kafka-protocol broker: the inbox under
//! concurrent and crashed consumers, the cron lock across processes, checkpointed
//! jobs killed mid-run, send-once notifications and the webhook example.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use outbox_client::consumer::amqp::{AmqpInbox, MissingIdPolicy};
use outbox_client::consumer::{apply_once, ConsumeError, Handler};
use outbox_client::inbox::{Inbox, Outcome};
use outbox_client::job_lock::{run_exclusive, Exclusive};
use outbox_client::send_once::{Notification, Order, SendOnce, SendOnceError, Sent};
use outbox_tests::db::{connect, TestDb};
use outbox_tests::{amqp_url, eventually, unique};
use rand::Rng;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;
use tokio_postgres::Transaction;

const WORKER_BIN: &str = env!("CARGO_BIN_EXE_consumer-defenses-worker");
const WEBHOOK_BIN: &str = env!("CARGO_BIN_EXE_webhook-example");
/// A ceiling on waits, never a claim about speed.
const PATIENCE: Duration = Duration::from_secs(120);

// ---------------------------------------------------------------- helpers

/// `schema.effects`: one counter per message, incremented by the handlers. A
/// value above 1 is an effect applied twice.
async fn create_effects(db: &TestDb) -> String {
    let t = format!("{}.effects", db.schema.quoted());
    db.client
        .batch_execute(&format!(
            "CREATE TABLE {t} (message text PRIMARY KEY, applied int NOT NULL)"
        ))
        .await
        .expect("create effects");
    t
}

async fn applied(db: &TestDb, table: &str, message: &str) -> i32 {
    db.client
        .query_opt(
            &format!("SELECT applied FROM {table} WHERE message = $1"),
            &[&message],
        )
        .await
        .expect("read effect")
        .map(|r| r.get(0))
        .unwrap_or(0)
}

/// Increments the delivery's counter; the body names it. With `fail_first`,
/// the first call fails after writing, so its rollback is what keeps it unseen.
struct CountEffect {
    table: String,
    fail_first: AtomicBool,
}

#[derive(Debug, thiserror::Error)]
enum EffectError {
    #[error("database")]
    Db(#[from] tokio_postgres::Error),
    #[error("injected failure")]
    Injected,
}

impl CountEffect {
    fn new(table: &str) -> Self {
        CountEffect {
            table: table.to_owned(),
            fail_first: AtomicBool::new(false),
        }
    }
}

impl Handler<Delivery> for CountEffect {
    type Error = EffectError;
    async fn handle(&self, tx: &Transaction<'_>, d: &Delivery) -> Result<(), EffectError> {
        let message = String::from_utf8_lossy(&d.data).into_owned();
        // Widen the window in which concurrent deliveries overlap.
        tx.execute("SELECT pg_sleep(0.02)", &[]).await?;
        tx.execute(
            &format!(
                "INSERT INTO {} (message, applied) VALUES ($1, 1) \
                 ON CONFLICT (message) DO UPDATE SET applied = {0}.applied + 1",
                self.table
            ),
            &[&message],
        )
        .await?;
        if self.fail_first.swap(false, Ordering::SeqCst) {
            return Err(EffectError::Injected);
        }
        Ok(())
    }
}

async fn amqp_connect() -> Connection {
    Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .expect("connect to rabbitmq")
}

/// A fresh queue on the default exchange, with `args`.
async fn declare_queue(ch: &Channel, name: &str, args: FieldTable) {
    ch.queue_declare(name.into(), QueueDeclareOptions::default(), args)
        .await
        .expect("declare queue");
}

/// Ready (unacked excluded) messages in `queue`.
async fn queue_depth(name: &str) -> u32 {
    let conn = amqp_connect().await;
    let ch = conn.create_channel().await.expect("channel");
    let q = ch
        .queue_declare(
            name.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("passive declare");
    let _ = conn.close(200, "ok".into()).await;
    q.message_count()
}

async fn delete_queue(name: &str) {
    let conn = amqp_connect().await;
    if let Ok(ch) = conn.create_channel().await {
        let _ = ch
            .queue_delete(name.into(), QueueDeleteOptions::default())
            .await;
    }
    let _ = conn.close(200, "ok".into()).await;
}

/// Publishes `copies` identical messages (same body, same message id when
/// given) to `queue` and waits for the broker's confirms.
async fn publish(queue: &str, body: &str, message_id: Option<&str>, copies: usize) {
    let conn = amqp_connect().await;
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm mode");
    for _ in 0..copies {
        let mut props = BasicProperties::default();
        if let Some(id) = message_id {
            props = props.with_message_id(id.into());
        }
        let confirm = ch
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                props,
            )
            .await
            .expect("publish");
        assert!(confirm.await.expect("confirm").is_ack(), "publish nacked");
    }
    let _ = conn.close(200, "ok".into()).await;
}

async fn consume(ch: &Channel, queue: &str, prefetch: u16) -> lapin::Consumer {
    ch.basic_qos(prefetch, BasicQosOptions::default())
        .await
        .expect("qos");
    ch.basic_consume(
        queue.into(),
        unique("c").as_str().into(),
        BasicConsumeOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("consume")
}

// ------------------------------------------------------------------ inbox

/// The inbox check alone: first New, then Duplicate, and a rolled-back record
/// leaves the id unseen.
#[tokio::test]
async fn inbox_records_in_the_callers_transaction() {
    let mut db = TestDb::new().await;
    let inbox = Inbox::with_schema(db.schema.clone());

    let tx = db.client.transaction().await.expect("tx");
    assert_eq!(
        inbox.process_once(&tx, "c", "m-1").await.expect("check"),
        Outcome::New
    );
    tx.rollback().await.expect("rollback");

    let tx = db.client.transaction().await.expect("tx");
    assert_eq!(
        inbox.process_once(&tx, "c", "m-1").await.expect("check"),
        Outcome::New,
        "a rolled-back record must not count"
    );
    tx.commit().await.expect("commit");

    let tx = db.client.transaction().await.expect("tx");
    assert_eq!(
        inbox.process_once(&tx, "c", "m-1").await.expect("check"),
        Outcome::Duplicate
    );
    assert_eq!(
        inbox
            .process_once(&tx, "other", "m-1")
            .await
            .expect("check"),
        Outcome::New,
        "consumers are independent"
    );
    tx.commit().await.expect("commit");

    // The SQL function for other languages agrees with the Rust check.
    let f = format!("{}.inbox_process_once", db.schema.quoted());
    let first: bool = db
        .client
        .query_one(&format!("SELECT {f}('sql', 'm-2')"), &[])
        .await
        .expect("function")
        .get(0);
    let again: bool = db
        .client
        .query_one(&format!("SELECT {f}('sql', 'm-2')"), &[])
        .await
        .expect("function")
        .get(0);
    assert!(first && !again);
    let tx = db.client.transaction().await.expect("tx");
    assert_eq!(
        inbox.process_once(&tx, "sql", "m-2").await.expect("check"),
        Outcome::Duplicate
    );
    drop(tx);

    let tx = db.client.transaction().await.expect("tx");
    assert!(inbox.process_once(&tx, "c", "").await.is_err());
    drop(tx);
    db.cleanup().await;
}

/// Retention deletes old entries in batches and keeps recent ones.
#[tokio::test]
async fn inbox_purge_deletes_only_entries_past_the_window() {
    let db = TestDb::new().await;
    let inbox = Inbox::with_schema(db.schema.clone());
    let table = format!("{}.inbox", db.schema.quoted());
    db.client
        .execute(
            &format!(
                "INSERT INTO {table} (consumer, message_id, processed_at) \
                 SELECT 'c', 'old-' || g, now() - interval '30 days' FROM generate_series(1, 2500) g"
            ),
            &[],
        )
        .await
        .expect("seed old");
    db.client
        .execute(
            &format!(
                "INSERT INTO {table} (consumer, message_id) \
                 SELECT 'c', 'new-' || g FROM generate_series(1, 10) g"
            ),
            &[],
        )
        .await
        .expect("seed new");
    let deleted = inbox
        .purge(&db.client, Duration::from_secs(14 * 86_400), 1000)
        .await
        .expect("purge");
    assert_eq!(deleted, 2500);
    let left: Vec<String> = db
        .client
        .query(&format!("SELECT message_id FROM {table}"), &[])
        .await
        .expect("left")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(left.len(), 10);
    assert!(left.iter().all(|m| m.starts_with("new-")));
    db.cleanup().await;
}

/// The same message delivered 10 times at once to 4 consumers, each with its
/// own broker and database connection: the effect is applied once, every copy
/// is acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_copies_to_four_consumers_apply_once() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let effects = create_effects(&db).await;
    let queue = unique("q");
    let setup = amqp_connect().await;
    let setup_ch = setup.create_channel().await.expect("channel");
    declare_queue(&setup_ch, &queue, FieldTable::default()).await;

    let message_id = uuid::Uuid::now_v7().to_string();
    let (tx, mut outcomes) = tokio::sync::mpsc::unbounded_channel::<(usize, Outcome)>();
    let mut consumers = Vec::new();
    for n in 0..4 {
        let config = db.config.clone();
        let inbox =
            AmqpInbox::new(Inbox::with_schema(db.schema.clone()), "counter").expect("consumer");
        let handler = CountEffect::new(&effects);
        let queue = queue.clone();
        let tx = tx.clone();
        consumers.push(tokio::spawn(async move {
            let mut client = connect(&config).await;
            let conn = amqp_connect().await;
            let ch = conn.create_channel().await.expect("channel");
            let mut deliveries = consume(&ch, &queue, 3).await;
            while let Some(d) = deliveries.next().await {
                let d = d.expect("delivery");
                let outcome = inbox
                    .handle(&mut client, &d, &handler)
                    .await
                    .expect("handled");
                let _ = tx.send((n, outcome));
            }
        }));
    }
    // Every consumer is subscribed before the copies arrive, so they spread.
    assert!(
        eventually(PATIENCE, || async {
            setup_ch
                .queue_declare(
                    queue.as_str().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..QueueDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map(|q| q.consumer_count() == 4)
                .unwrap_or(false)
        })
        .await,
        "consumers did not subscribe"
    );
    publish(&queue, "m", Some(&message_id), 10).await;

    let mut seen = Vec::new();
    while seen.len() < 10 {
        match tokio::time::timeout(PATIENCE, outcomes.recv()).await {
            Ok(Some(o)) => seen.push(o),
            _ => panic!("only {} of 10 copies handled", seen.len()),
        }
    }
    for c in consumers {
        c.abort();
    }
    let new = seen.iter().filter(|(_, o)| *o == Outcome::New).count();
    let by_consumer = seen.iter().fold(HashMap::new(), |mut m, (n, _)| {
        *m.entry(*n).or_insert(0) += 1;
        m
    });
    println!("outcomes per consumer: {by_consumer:?}");
    assert_eq!(new, 1, "exactly one copy is new: {seen:?}");
    assert_eq!(applied(&db, &effects, "m").await, 1);
    assert_eq!(queue_depth(&queue).await, 0, "every copy acked");
    delete_queue(&queue).await;
    let _ = setup.close(200, "ok".into()).await;
    db.cleanup().await;
}

/// A consumer commits its effect and dies before acking (its connection drops):
/// RabbitMQ redelivers, the redelivery is recognized and acked, the effect is
/// not repeated.
#[tokio::test]
async fn amqp_crash_between_commit_and_ack_is_recognized() {
    let db = TestDb::new().await;
    let effects = create_effects(&db).await;
    let queue = unique("q");
    let setup = amqp_connect().await;
    let setup_ch = setup.create_channel().await.expect("channel");
    declare_queue(&setup_ch, &queue, FieldTable::default()).await;
    let message_id = uuid::Uuid::now_v7().to_string();
    publish(&queue, "crash", Some(&message_id), 1).await;
    let inbox = Inbox::with_schema(db.schema.clone());
    let handler = CountEffect::new(&effects);

    // The doomed consumer: the effect commits, then the connection goes away
    // without an ack, as when the process is killed.
    {
        let mut client = connect(&db.config).await;
        let conn = amqp_connect().await;
        let ch = conn.create_channel().await.expect("channel");
        let mut deliveries = consume(&ch, &queue, 1).await;
        let d = tokio::time::timeout(PATIENCE, deliveries.next())
            .await
            .expect("delivery in time")
            .expect("stream open")
            .expect("delivery");
        assert!(!d.redelivered);
        let outcome = apply_once(&mut client, &inbox, "counter", &message_id, &d, &handler)
            .await
            .expect("applied");
        assert_eq!(outcome, Outcome::New);
        let _ = conn.close(320, "crash".into()).await;
    }
    assert_eq!(applied(&db, &effects, "crash").await, 1);

    let mut client = connect(&db.config).await;
    let conn = amqp_connect().await;
    let ch = conn.create_channel().await.expect("channel");
    let mut deliveries = consume(&ch, &queue, 1).await;
    let d = tokio::time::timeout(PATIENCE, deliveries.next())
        .await
        .expect("redelivery in time")
        .expect("stream open")
        .expect("delivery");
    assert!(d.redelivered, "the broker redelivers the unacked message");
    let consumer = AmqpInbox::new(inbox, "counter").expect("consumer");
    let outcome = consumer
        .handle(&mut client, &d, &handler)
        .await
        .expect("handled");
    assert_eq!(outcome, Outcome::Duplicate);
    let _ = conn.close(200, "ok".into()).await;
    assert_eq!(
        applied(&db, &effects, "crash").await,
        1,
        "effect not repeated"
    );
    assert_eq!(queue_depth(&queue).await, 0, "the redelivery was acked");
    delete_queue(&queue).await;
    let _ = setup.close(200, "ok".into()).await;
    db.cleanup().await;
}

/// A handler error rolls the effect back and requeues the delivery; the next
/// attempt applies it, once.
#[tokio::test]
async fn handler_error_means_redelivery_not_ack() {
    let db = TestDb::new().await;
    let effects = create_effects(&db).await;
    let queue = unique("q");
    let setup = amqp_connect().await;
    let setup_ch = setup.create_channel().await.expect("channel");
    declare_queue(&setup_ch, &queue, FieldTable::default()).await;
    publish(&queue, "flaky", Some("id-flaky"), 1).await;

    let handler = CountEffect::new(&effects);
    handler.fail_first.store(true, Ordering::SeqCst);
    let consumer =
        AmqpInbox::new(Inbox::with_schema(db.schema.clone()), "counter").expect("consumer");
    let mut client = connect(&db.config).await;
    let conn = amqp_connect().await;
    let ch = conn.create_channel().await.expect("channel");
    let mut deliveries = consume(&ch, &queue, 1).await;
    let mut results = Vec::new();
    for _ in 0..2 {
        let d = tokio::time::timeout(PATIENCE, deliveries.next())
            .await
            .expect("delivery in time")
            .expect("stream open")
            .expect("delivery");
        results.push((
            d.redelivered,
            consumer.handle(&mut client, &d, &handler).await,
        ));
    }
    assert!(matches!(
        results[0],
        (false, Err(ConsumeError::Handler(EffectError::Injected)))
    ));
    assert!(
        matches!(results[1], (true, Ok(Outcome::New))),
        "{results:?}"
    );
    let _ = conn.close(200, "ok".into()).await;
    assert_eq!(applied(&db, &effects, "flaky").await, 1);
    assert_eq!(queue_depth(&queue).await, 0);
    delete_queue(&queue).await;
    let _ = setup.close(200, "ok".into()).await;
    db.cleanup().await;
}

/// A delivery without a message id is a clear error, and the dead-letter
/// policy sends it to the queue's dead-letter exchange instead of requeueing.
#[tokio::test]
async fn missing_message_id_is_dead_lettered() {
    let db = TestDb::new().await;
    let effects = create_effects(&db).await;
    let queue = unique("q");
    let dlq = unique("dlq");
    let setup = amqp_connect().await;
    let setup_ch = setup.create_channel().await.expect("channel");
    declare_queue(&setup_ch, &dlq, FieldTable::default()).await;
    let mut args = FieldTable::default();
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("".into()),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(dlq.as_str().into()),
    );
    declare_queue(&setup_ch, &queue, args).await;
    publish(&queue, "anonymous", None, 1).await;

    let consumer = AmqpInbox::new(Inbox::with_schema(db.schema.clone()), "counter")
        .expect("consumer")
        .missing_id(MissingIdPolicy::DeadLetter);
    let mut client = connect(&db.config).await;
    let conn = amqp_connect().await;
    let ch = conn.create_channel().await.expect("channel");
    let mut deliveries = consume(&ch, &queue, 1).await;
    let d = tokio::time::timeout(PATIENCE, deliveries.next())
        .await
        .expect("delivery in time")
        .expect("stream open")
        .expect("delivery");
    let handler = CountEffect::new(&effects);
    let result = consumer.handle(&mut client, &d, &handler).await;
    assert!(matches!(result, Err(ConsumeError::MissingMessageId)));
    assert!(
        eventually(PATIENCE, || async { queue_depth(&dlq).await == 1 }).await,
        "not dead-lettered"
    );
    let _ = conn.close(200, "ok".into()).await;
    assert_eq!(queue_depth(&queue).await, 0, "not requeued");
    assert_eq!(applied(&db, &effects, "anonymous").await, 0);
    delete_queue(&queue).await;
    delete_queue(&dlq).await;
    let _ = setup.close(200, "ok".into()).await;
    db.cleanup().await;
}

// ------------------------------------------------------------------ kafka

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
        tx.execute(
            &format!(
                "INSERT INTO {} (message, applied) VALUES ($1, 1) \
                 ON CONFLICT (message) DO UPDATE SET applied = {0}.applied + 1",
                self.table
            ),
            &[&message],
        )
        .await?;
        Ok(())
    }
}

/// Kafka: a consumer commits its effect and dies before committing the offset;
/// the next consumer of the group reads the record again, recognizes it and
/// commits the offset, and the effect is not repeated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_crash_between_commit_and_offset_commit_is_recognized() {
    use outbox_client::consumer::kafka::KafkaInbox;
    use rdkafka::consumer::{Consumer, StreamConsumer};
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    use rdkafka::{ClientConfig, Offset, TopicPartitionList};

    let brokers = outbox_tests::kafka_brokers();
    let db = TestDb::new().await;
    let effects = create_effects(&db).await;
    let topic = unique("t");
    outbox_tests::kafka::create_topic(&brokers, &topic, 1).await;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .expect("producer");
    let message_id = uuid::Uuid::now_v7().to_string();
    producer
        .send(
            FutureRecord::to(&topic)
                .payload("k-crash")
                .key("k")
                .headers(OwnedHeaders::new().insert(Header {
                    key: "message-id",
                    value: Some(message_id.as_str()),
                })),
            Duration::from_secs(30),
        )
        .await
        .map_err(|(e, _)| e)
        .expect("produce");

    let group = unique("g");
    let new_consumer = || {
        let c: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", &group)
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .create()
            .expect("consumer");
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&topic, 0, Offset::Stored)
            .expect("partition");
        c.assign(&tpl).expect("assign");
        c
    };
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
        assert_eq!(outcome, Outcome::New);
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
    assert_eq!(outcome, Outcome::Duplicate);
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

// ------------------------------------------------------------------- cron

async fn cron_tables(db: &TestDb) {
    let s = db.schema.quoted();
    db.client
        .batch_execute(&format!(
            "CREATE TABLE {s}.cron_runs (pid bigint NOT NULL); \
             CREATE TABLE {s}.cron_release (at timestamptz DEFAULT now())"
        ))
        .await
        .expect("cron tables");
}

/// Three processes start the same job at once: one runs it, two find it busy.
/// The runner holds the lock until released, so the overlap does not depend on
/// timing.
#[tokio::test]
async fn cron_job_started_by_three_processes_runs_once() {
    let db = TestDb::new().await;
    cron_tables(&db).await;
    let job = unique("report");
    let mut children: Vec<_> = (0..3)
        .map(|_| {
            Command::new(WORKER_BIN)
                .args(["cron", db.schema.as_str(), job.as_str()])
                .stdout(Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .expect("spawn worker")
        })
        .collect();
    let runs = format!("SELECT count(*) FROM {}.cron_runs", db.schema.quoted());

    // Wait for two processes to give up (busy) and one to be running the job.
    let mut exits = Vec::new();
    for child in &mut children {
        exits.push(child.try_wait().expect("poll"));
    }
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        for (i, child) in children.iter_mut().enumerate() {
            if exits[i].is_none() {
                exits[i] = child.try_wait().expect("poll");
            }
        }
        let started: i64 = db.client.query_one(&runs, &[]).await.expect("runs").get(0);
        if exits.iter().filter(|e| e.is_some()).count() == 2 && started == 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no settled state: exits {exits:?}, runs {started}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let busy: Vec<_> = exits.iter().flatten().map(|s| s.code()).collect();
    assert_eq!(busy, vec![Some(3), Some(3)], "the others found it busy");

    db.client
        .execute(
            &format!(
                "INSERT INTO {}.cron_release DEFAULT VALUES",
                db.schema.quoted()
            ),
            &[],
        )
        .await
        .expect("release");
    let mut outputs = Vec::new();
    for child in children {
        let out = tokio::time::timeout(PATIENCE, child.wait_with_output())
            .await
            .expect("worker exits")
            .expect("wait");
        outputs.push(String::from_utf8_lossy(&out.stdout).trim().to_owned());
    }
    outputs.sort();
    assert_eq!(outputs, ["busy", "busy", "ran"]);
    let started: i64 = db.client.query_one(&runs, &[]).await.expect("runs").get(0);
    assert_eq!(started, 1, "the job ran once");
    assert_eq!(advisory_locks_held(&db, &job).await, 0, "lock released");
    db.cleanup().await;
}

async fn advisory_locks_held(db: &TestDb, name: &str) -> i64 {
    db.client
        .query_one(
            "SELECT count(*) FROM pg_locks l, (SELECT hashtextextended($1, 0) AS k) h \
             WHERE l.locktype = 'advisory' AND l.granted \
               AND l.classid::bigint = ((h.k >> 32) & 4294967295) \
               AND l.objid::bigint = (h.k & 4294967295)",
            &[&name],
        )
        .await
        .expect("pg_locks")
        .get(0)
}

/// A job that panics releases the lock: the panic reaches the caller, and the
/// next run takes the lock at once.
#[tokio::test]
async fn cron_job_that_panics_releases_the_lock() {
    let db = TestDb::new().await;
    let job = unique("panics");
    let config = db.config.clone();
    let name = job.clone();
    let (running_tx, running_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        run_exclusive(&config, &name, |_| async move {
            let _ = running_tx.send(());
            tokio::task::yield_now().await;
            panic!("job failed");
        })
        .await
    });
    let _ = running_rx.await;
    let err = task.await.expect_err("the panic propagates");
    assert!(err.is_panic());
    assert!(
        eventually(PATIENCE, || async {
            advisory_locks_held(&db, &job).await == 0
        })
        .await,
        "lock still held after the panic"
    );
    let again = run_exclusive(&db.config, &job, |_| async { 7 })
        .await
        .expect("lock");
    assert_eq!(again, Exclusive::Ran(7));

    // While one run holds the lock, another is busy; dropping the holder mid-job
    // (cancellation) releases the lock too.
    let (held_tx, held_rx) = tokio::sync::oneshot::channel::<()>();
    let config = db.config.clone();
    let name = job.clone();
    let holder = tokio::spawn(async move {
        run_exclusive(&config, &name, |lease| async move {
            assert!(lease.is_held());
            let _ = held_tx.send(());
            futures::future::pending::<()>().await;
        })
        .await
    });
    held_rx.await.expect("holder runs");
    let busy = run_exclusive(&db.config, &job, |_| async {})
        .await
        .expect("lock query");
    assert_eq!(busy, Exclusive::Busy);
    holder.abort();
    let _ = holder.await;
    assert!(
        eventually(PATIENCE, || async {
            advisory_locks_held(&db, &job).await == 0
        })
        .await,
        "lock still held after cancellation"
    );
    db.cleanup().await;
}

// ------------------------------------------------------------- checkpoint

/// A checkpointed job over 100,000 rows, SIGKILLed at random points and
/// restarted until done: every row's effect is applied exactly once.
#[tokio::test]
async fn checkpointed_job_killed_at_random_points_applies_each_row_once() {
    const ROWS: i64 = 100_000;
    let db = TestDb::new().await;
    let s = db.schema.quoted();
    db.client
        .batch_execute(&format!(
            "CREATE TABLE {s}.items (id bigint PRIMARY KEY, hits int NOT NULL DEFAULT 0); \
             INSERT INTO {s}.items (id) SELECT g FROM generate_series(1, {ROWS}) g"
        ))
        .await
        .expect("seed items");
    let job = outbox_client::checkpoint::Checkpoint::new(db.schema.clone(), "recount")
        .expect("checkpoint");
    let spawn = || {
        Command::new(WORKER_BIN)
            .args(["checkpoint", db.schema.as_str(), "recount", "1000"])
            .kill_on_drop(true)
            .spawn()
            .expect("spawn worker")
    };

    let mut kills = 0;
    let mut last_target = 0i64;
    while kills < 5 {
        // Random points, spread over the run and rising, so each restart resumes
        // from a different place.
        let target = last_target + rand::rng().random_range(2_000..18_000);
        let mut child = spawn();
        let reached = eventually(PATIENCE, || async {
            job.position(&db.client)
                .await
                .expect("position")
                .unwrap_or(0)
                >= target
        })
        .await;
        assert!(reached, "no progress to {target}");
        assert!(
            child.try_wait().expect("poll").is_none(),
            "worker finished before it could be killed"
        );
        child.start_kill().expect("SIGKILL");
        let _ = child.wait().await;
        let at = job
            .position(&db.client)
            .await
            .expect("position")
            .unwrap_or(0);
        println!("killed at position {at} (target {target})");
        assert!(at < ROWS, "killed only after finishing");
        last_target = at;
        kills += 1;
    }
    let status = tokio::time::timeout(PATIENCE, spawn().wait())
        .await
        .expect("final run finishes")
        .expect("wait");
    assert!(status.success(), "final run failed: {status}");

    let (total, once, position): (i64, i64, Option<i64>) = {
        let r = db
            .client
            .query_one(
                &format!("SELECT count(*), count(*) FILTER (WHERE hits = 1) FROM {s}.items"),
                &[],
            )
            .await
            .expect("count");
        (
            r.get(0),
            r.get(1),
            job.position(&db.client).await.expect("position"),
        )
    };
    assert_eq!(total, ROWS);
    assert_eq!(once, ROWS, "rows applied other than once");
    assert_eq!(position, Some(ROWS));
    db.cleanup().await;
}

// -------------------------------------------------------------- send once

/// Both orders: concurrent attempts send once; a failed send is retried under
/// send-then-record and left unsent (and listed) under record-then-send.
#[tokio::test]
async fn send_once_orders_behave_as_documented() {
    let db = TestDb::new().await;
    let notes = SendOnce::with_schema(db.schema.clone());

    for order in [Order::RecordThenSend, Order::SendThenRecord] {
        let n = Notification::new("user-1", format!("{order:?}"), "once").expect("key");
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let attempts = (0..8).map(|_| {
            let notes = notes.clone();
            let n = n.clone();
            let calls = Arc::clone(&calls);
            let config = db.config.clone();
            tokio::spawn(async move {
                let mut client = connect(&config).await;
                notes
                    .send(&mut client, &n, order, || async {
                        calls.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        Ok::<(), std::io::Error>(())
                    })
                    .await
                    .expect("send once")
            })
        });
        let results = futures::future::join_all(attempts).await;
        let sent = results
            .into_iter()
            .filter(|r| *r.as_ref().expect("task") == Sent::Sent)
            .count();
        assert_eq!(sent, 1, "{order:?}");
        assert_eq!(calls.load(Ordering::SeqCst), 1, "{order:?}");
    }

    let mut client = connect(&db.config).await;
    let fail = || async { Err::<(), _>(std::io::Error::other("smtp down")) };
    let ok = || async { Ok::<(), std::io::Error>(()) };

    let email = Notification::new("user-2", "welcome", "once").expect("key");
    let r = notes
        .send(&mut client, &email, Order::SendThenRecord, fail)
        .await;
    assert!(matches!(r, Err(SendOnceError::Send(_))));
    let r = notes
        .send(&mut client, &email, Order::SendThenRecord, ok)
        .await;
    assert!(
        matches!(r, Ok(Sent::Sent)),
        "send-then-record retries a failed send"
    );

    let payout = Notification::new("user-2", "payout", "2026-W42").expect("key");
    let r = notes
        .send(&mut client, &payout, Order::RecordThenSend, fail)
        .await;
    assert!(matches!(r, Err(SendOnceError::Send(_))));
    let r = notes
        .send(&mut client, &payout, Order::RecordThenSend, ok)
        .await;
    assert!(
        matches!(r, Ok(Sent::AlreadySent)),
        "record-then-send never repeats"
    );
    let unconfirmed = notes
        .unconfirmed(&client, Duration::ZERO)
        .await
        .expect("unconfirmed");
    assert_eq!(unconfirmed, vec![payout.clone()]);
    assert!(notes.forget(&client, &payout).await.expect("forget"));
    let r = notes
        .send(&mut client, &payout, Order::RecordThenSend, ok)
        .await;
    assert!(matches!(r, Ok(Sent::Sent)));
    assert!(notes
        .unconfirmed(&client, Duration::ZERO)
        .await
        .expect("unconfirmed")
        .is_empty());
    db.cleanup().await;
}

// ---------------------------------------------------------------- webhook

/// POSTs `body` to `addr` over plain HTTP/1.1 and returns the status code and body.
async fn post(addr: &str, path: &str, body: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to webhook");
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream
        .write_all(request.as_bytes())
        .await
        .expect("send request");
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .await
        .expect("read response");
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.trim().to_owned())
        .unwrap_or_default();
    (status, body)
}

/// The webhook example as a process: one event posted 5 times at once is
/// applied once, and every response is 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_event_posted_five_times_is_applied_once_all_200() {
    let db = TestDb::new().await;
    let mut server = Command::new(WEBHOOK_BIN)
        .env("DATABASE_URL", outbox_tests::pg_url())
        .env("WEBHOOK_SCHEMA", db.schema.as_str())
        .env("WEBHOOK_ADDR", "127.0.0.1:0")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn webhook example");
    let stdout = server.stdout.take().expect("stdout");
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = tokio::time::timeout(PATIENCE, lines.next_line())
        .await
        .expect("server starts")
        .expect("read stdout")
        .expect("a line");
    let addr = line
        .strip_prefix("listening on ")
        .expect("listening line")
        .to_owned();

    let event =
        r#"{"id":"evt_1Nx","type":"credit.granted","data":{"account":"acme","amount":100}}"#;
    let posts = (0..5).map(|_| {
        let addr = addr.clone();
        tokio::spawn(async move { post(&addr, "/webhooks/payments", event).await })
    });
    let responses: Vec<(u16, String)> = futures::future::join_all(posts)
        .await
        .into_iter()
        .map(|r| r.expect("task"))
        .collect();
    assert!(
        responses.iter().all(|(status, _)| *status == 200),
        "{responses:?}"
    );
    assert_eq!(
        responses.iter().filter(|(_, b)| b == "applied").count(),
        1,
        "{responses:?}"
    );
    let credits: i64 = db
        .client
        .query_one(
            &format!(
                "SELECT credits FROM {}.webhook_accounts WHERE account = 'acme'",
                db.schema.quoted()
            ),
            &[],
        )
        .await
        .expect("credits")
        .get(0);
    assert_eq!(credits, 100, "applied once");

    // A later resend is still a 200 duplicate.
    let (status, body) = post(&addr, "/webhooks/payments", event).await;
    assert_eq!((status, body.as_str()), (200, "duplicate"));
    let _ = server.kill().await;
    db.cleanup().await;
}
