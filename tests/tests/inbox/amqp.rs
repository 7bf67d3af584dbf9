//! The AMQP consumer helpers: many copies to concurrent consumers, a crash
//! between commit and ack, a failing handler, a delivery without a message id.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable};
use lapin::Channel;
use outbox_client::consumer::amqp::{AmqpInbox, MissingIdPolicy};
use outbox_client::consumer::{apply_once, ConsumeError, Handler};
use outbox_client::inbox::{Arrival, Inbox};
use outbox_tests::amqp::{self, consume, declare_queue, delete_queue, publish, queue_depth};
use outbox_tests::db::{connect, TestDb};
use outbox_tests::{eventually, unique};
use tokio_postgres::Transaction;

use super::{applied, apply_effect, create_effects, PATIENCE};

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
        apply_effect(tx, &self.table, &message).await?;
        if self.fail_first.swap(false, Ordering::SeqCst) {
            return Err(EffectError::Injected);
        }
        Ok(())
    }
}

/// One test's world: a schema with the effects table, and a fresh queue
/// declared over a broker connection of its own.
struct Scene {
    db: TestDb,
    effects: String,
    queue: String,
    setup: lapin::Connection,
    setup_ch: Channel,
}

impl Scene {
    /// A scene whose queue is declared with `args`.
    async fn new(args: FieldTable) -> Scene {
        let db = TestDb::new().await;
        let effects = create_effects(&db).await;
        let queue = unique("q");
        let setup = amqp::connection().await;
        let setup_ch = setup.create_channel().await.expect("channel");
        declare_queue(&setup_ch, &queue, args).await;
        Scene {
            db,
            effects,
            queue,
            setup,
            setup_ch,
        }
    }

    /// A consumer with connections of its own, `prefetch` deliveries at a
    /// time.
    async fn consumer(&self, prefetch: u16) -> Consumer {
        let client = connect(&self.db.config).await;
        let conn = amqp::connection().await;
        let channel = conn.create_channel().await.expect("channel");
        let deliveries = consume(&channel, &self.queue, prefetch).await;
        Consumer {
            client,
            conn,
            _channel: channel,
            deliveries,
        }
    }

    /// How many times `message`'s effect was applied.
    async fn applied(&self, message: &str) -> i32 {
        applied(&self.db, &self.effects, message).await
    }

    /// Checks that nothing is left in the queue (every copy acked, nothing
    /// requeued), then removes what the scene made.
    async fn finish(self) {
        assert_eq!(queue_depth(&self.queue).await, 0, "every copy acked");
        delete_queue(&self.queue).await;
        let _ = self.setup.close(200, "ok".into()).await;
        self.db.cleanup().await;
    }
}

/// A consumer's own database session and broker connection.
struct Consumer {
    client: tokio_postgres::Client,
    conn: lapin::Connection,
    _channel: Channel,
    deliveries: lapin::Consumer,
}

impl Consumer {
    /// The next delivery, waited for up to [`PATIENCE`]; `what` names it in
    /// the panic.
    async fn next(&mut self, what: &str) -> Delivery {
        tokio::time::timeout(PATIENCE, self.deliveries.next())
            .await
            .unwrap_or_else(|_| panic!("no {what} within {PATIENCE:?}"))
            .expect("stream open")
            .expect("delivery")
    }

    /// Closes the broker connection: unacked deliveries go back to the queue,
    /// as when the process dies.
    async fn close(self) {
        let _ = self.conn.close(200, "ok".into()).await;
    }
}

/// The same message delivered 10 times at once to 4 consumers, each with its
/// own broker and database connection: the effect is applied once, every copy
/// is acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_copies_to_four_consumers_apply_once() {
    outbox_tests::init_logging();
    let scene = Scene::new(FieldTable::default()).await;
    let message_id = uuid::Uuid::now_v7().to_string();
    let (tx, mut outcomes) = tokio::sync::mpsc::unbounded_channel::<(usize, Arrival)>();
    let mut consumers = Vec::new();
    for n in 0..4 {
        let inbox = AmqpInbox::new(Inbox::with_schema(scene.db.schema.clone()), "counter")
            .expect("consumer");
        let handler = CountEffect::new(&scene.effects);
        let mut consumer = scene.consumer(3).await;
        let tx = tx.clone();
        consumers.push(tokio::spawn(async move {
            while let Some(d) = consumer.deliveries.next().await {
                let d = d.expect("delivery");
                let outcome = inbox
                    .handle(&mut consumer.client, &d, &handler)
                    .await
                    .expect("handled");
                let _ = tx.send((n, outcome));
            }
        }));
    }
    // Every consumer is subscribed before the copies arrive, so they spread.
    assert!(
        eventually(PATIENCE, || async {
            scene
                .setup_ch
                .queue_declare(
                    scene.queue.as_str().into(),
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
    publish(&scene.queue, "m", Some(&message_id), 10).await;

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
    let new = seen.iter().filter(|(_, o)| *o == Arrival::New).count();
    let by_consumer = seen.iter().fold(HashMap::new(), |mut m, (n, _)| {
        *m.entry(*n).or_insert(0) += 1;
        m
    });
    println!("outcomes per consumer: {by_consumer:?}");
    assert_eq!(new, 1, "exactly one copy is new: {seen:?}");
    assert_eq!(scene.applied("m").await, 1);
    scene.finish().await;
}

/// A consumer commits its effect and dies before acking (its connection drops):
/// RabbitMQ redelivers, the redelivery is recognized and acked, the effect is
/// not repeated.
#[tokio::test]
async fn amqp_crash_between_commit_and_ack_is_recognized() {
    let scene = Scene::new(FieldTable::default()).await;
    let message_id = uuid::Uuid::now_v7().to_string();
    publish(&scene.queue, "crash", Some(&message_id), 1).await;
    let inbox = Inbox::with_schema(scene.db.schema.clone());
    let handler = CountEffect::new(&scene.effects);

    // The doomed consumer: the effect commits, then the connection goes away
    // without an ack, as when the process is killed.
    let mut doomed = scene.consumer(1).await;
    let d = doomed.next("delivery").await;
    assert!(!d.redelivered);
    let outcome = apply_once(
        &mut doomed.client,
        &inbox,
        "counter",
        &message_id,
        &d,
        &handler,
    )
    .await
    .expect("applied");
    assert_eq!(outcome, Arrival::New);
    doomed.close().await;
    assert_eq!(scene.applied("crash").await, 1);

    let mut next = scene.consumer(1).await;
    let d = next.next("redelivery").await;
    assert!(d.redelivered, "the broker redelivers the unacked message");
    let consumer = AmqpInbox::new(inbox, "counter").expect("consumer");
    let outcome = consumer
        .handle(&mut next.client, &d, &handler)
        .await
        .expect("handled");
    assert_eq!(outcome, Arrival::Duplicate);
    next.close().await;
    assert_eq!(scene.applied("crash").await, 1, "effect not repeated");
    scene.finish().await;
}

/// A handler error rolls the effect back and requeues the delivery; the next
/// attempt applies it, once.
#[tokio::test]
async fn handler_error_means_redelivery_not_ack() {
    let scene = Scene::new(FieldTable::default()).await;
    publish(&scene.queue, "flaky", Some("id-flaky"), 1).await;

    let handler = CountEffect::new(&scene.effects);
    handler.fail_first.store(true, Ordering::SeqCst);
    let inbox =
        AmqpInbox::new(Inbox::with_schema(scene.db.schema.clone()), "counter").expect("consumer");
    let mut consumer = scene.consumer(1).await;
    let mut results = Vec::new();
    for _ in 0..2 {
        let d = consumer.next("delivery").await;
        results.push((
            d.redelivered,
            inbox.handle(&mut consumer.client, &d, &handler).await,
        ));
    }
    assert!(matches!(
        results[0],
        (false, Err(ConsumeError::Handler(EffectError::Injected)))
    ));
    assert!(
        matches!(results[1], (true, Ok(Arrival::New))),
        "{results:?}"
    );
    consumer.close().await;
    assert_eq!(scene.applied("flaky").await, 1);
    scene.finish().await;
}

/// Applies the effect; on its first call it then runs a statement that
/// fails, and goes on as if it had not (a unique violation taken as
/// "already there", say), returning `Ok`.
struct SwallowFirst {
    table: String,
    swallow: AtomicBool,
}

impl Handler<Delivery> for SwallowFirst {
    type Error = EffectError;
    async fn handle(&self, tx: &Transaction<'_>, d: &Delivery) -> Result<(), EffectError> {
        let message = String::from_utf8_lossy(&d.data).into_owned();
        apply_effect(tx, &self.table, &message).await?;
        if self.swallow.swap(false, Ordering::SeqCst) {
            let failed = tx.batch_execute("SELECT 1/0").await;
            assert!(failed.is_err(), "the statement meant to fail went through");
        }
        Ok(())
    }
}

/// A handler that swallows a failed statement's error and returns `Ok` has
/// left its transaction aborted. Postgres answers the COMMIT of an aborted
/// transaction by rolling it back, without an error: the delivery was acked
/// with neither its effect nor its id recorded, and the message was lost.
/// Now the helper tells, requeues, and the next delivery applies it once.
#[tokio::test]
async fn a_handler_returning_ok_from_an_aborted_transaction_gets_its_message_again() {
    let scene = Scene::new(FieldTable::default()).await;
    publish(&scene.queue, "swallowed", Some("id-swallowed"), 1).await;
    let handler = SwallowFirst {
        table: scene.effects.clone(),
        swallow: AtomicBool::new(true),
    };
    let inbox =
        AmqpInbox::new(Inbox::with_schema(scene.db.schema.clone()), "counter").expect("consumer");
    let mut consumer = scene.consumer(1).await;
    let d = consumer.next("delivery").await;
    let first = inbox.handle(&mut consumer.client, &d, &handler).await;
    assert!(
        matches!(first, Err(ConsumeError::Aborted(_))),
        "the aborted transaction was taken for a commit: {first:?}, effect applied {} times",
        scene.applied("swallowed").await
    );
    let again = consumer.next("redelivery").await;
    assert!(again.redelivered);
    let second = inbox.handle(&mut consumer.client, &again, &handler).await;
    assert!(matches!(second, Ok(Arrival::New)), "{second:?}");
    consumer.close().await;
    assert_eq!(scene.applied("swallowed").await, 1);
    scene.finish().await;
}

/// A delivery without a usable message id is a clear error, and the
/// dead-letter policy sends it to the queue's dead-letter exchange instead of
/// requeueing. An id that holds a NUL character cannot be recorded (Postgres
/// text cannot store one): it was requeued on every delivery, forever, and
/// now goes the same way as a missing one.
#[tokio::test]
async fn missing_message_id_is_dead_lettered() {
    let dlq = unique("dlq");
    let mut args = FieldTable::default();
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("".into()),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(dlq.as_str().into()),
    );
    let scene = Scene::new(args).await;
    declare_queue(&scene.setup_ch, &dlq, FieldTable::default()).await;
    publish(&scene.queue, "anonymous", None, 1).await;
    publish(&scene.queue, "nul-id", Some("m\0"), 1).await;

    let inbox = AmqpInbox::new(Inbox::with_schema(scene.db.schema.clone()), "counter")
        .expect("consumer")
        .missing_id(MissingIdPolicy::DeadLetter);
    let mut consumer = scene.consumer(1).await;
    let handler = CountEffect::new(&scene.effects);
    for (depth, what) in [
        (1, "delivery without an id"),
        (2, "delivery with a NUL in its id"),
    ] {
        let d = consumer.next(what).await;
        let result = inbox.handle(&mut consumer.client, &d, &handler).await;
        assert!(
            matches!(result, Err(ConsumeError::MissingMessageId)),
            "{what}: {result:?}"
        );
        assert!(
            eventually(PATIENCE, || async { queue_depth(&dlq).await == depth }).await,
            "{what}: not dead-lettered"
        );
    }
    consumer.close().await;
    assert_eq!(scene.applied("anonymous").await, 0);
    assert_eq!(scene.applied("nul-id").await, 0);
    delete_queue(&dlq).await;
    // The queue itself is empty: the delivery was not requeued.
    scene.finish().await;
}
