//! The whole path to a real RabbitMQ: write in a transaction, relay, consume.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use outbox_client::Message;
use outbox_relay::publish::amqp::{AmqpPublisher, AmqpSettings};
use outbox_relay::publish::{Envelope, Publisher};
use outbox_tests::amqp::{self, Fixture};
use outbox_tests::check::check;
use outbox_tests::db::TestDb;
use outbox_tests::proxy::Proxy;
use outbox_tests::workload::{self, Spec};
use outbox_tests::{eventually, fast_settings, seen_amqp, InProcessRelay};

const TMP: &str = env!("CARGO_TARGET_TMPDIR");
/// Ceiling on waits for delivery; a healthy run needs a small fraction of it.
const PATIENCE: Duration = Duration::from_secs(120);

#[tokio::test]
async fn wire_contract_message_id_headers_and_properties() {
    outbox_tests::init_logging();
    let mut db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let relay = InProcessRelay::amqp(&db, fast_settings());

    let before = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let m = Message::builder(rabbit.exchange.as_str())
        .key("order-1")
        .routing_key("orders.paid")
        .header("tenant", "acme")
        .header(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        )
        .content_type("application/vnd.test+json")
        .payload(br#"{"x":1}"#.to_vec())
        .build()
        .expect("valid");
    // Written an hour ago, as far as the row says: the timestamp must be
    // the row's, not when it was published.
    let (outbox, table) = (db.outbox(), db.table());
    let tx = db.client.transaction().await.expect("begin");
    let id = outbox.enqueue(&tx, &m).await.expect("enqueue");
    tx.execute(
        format!(
            "UPDATE {table} SET created_at = created_at - interval '1 hour' WHERE message_id = $1"
        )
        .as_str(),
        &[&id.as_uuid()],
    )
    .await
    .expect("backdate");
    tx.commit().await.expect("commit");

    assert!(
        eventually(PATIENCE, || async { rabbit.count() >= 1 }).await,
        "not delivered"
    );
    let d = &rabbit.deliveries()[0];
    assert_eq!(d.message_id, id.to_string());
    assert_eq!(d.routing_key, "orders.paid");
    assert_eq!(d.content_type.as_deref(), Some("application/vnd.test+json"));
    assert_eq!(d.delivery_mode, Some(2), "persistent");
    let ts = d.timestamp.expect("timestamp set");
    assert!(
        ts + 3600 + 5 >= before && ts + 3600 <= before + 60,
        "timestamp {ts} is the row's creation time, an hour before {before}"
    );
    assert_eq!(d.headers.get("tenant").map(String::as_str), Some("acme"));
    assert!(d.headers.contains_key("traceparent"));
    assert_eq!(d.payload, br#"{"x":1}"#);
    assert!(
        eventually(PATIENCE, || async { db.pending().await == 0 }).await,
        "row not deleted"
    );

    relay.stop().await;
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// 8 writers, 10,000 committed messages over 50 keys (each key owned by one
/// writer), about 10% of transactions rolled back, relay running throughout.
#[tokio::test]
async fn concurrent_writers_every_commit_delivered_in_key_order() {
    let started = std::time::Instant::now();
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let relay = InProcessRelay::amqp(&db, fast_settings());

    let spec = Spec::new(&rabbit.exchange, 8, 50, 10_000);
    let written = workload::run(&db.config, &db.outbox(), &spec).await;
    assert_eq!(written.committed.len(), 10_000);
    assert!(
        !written.rolled_back.is_empty(),
        "the workload rolls some back"
    );

    rabbit
        .expect_at_least(written.committed.len(), PATIENCE)
        .await;
    // Give strays (rolled-back rows, duplicates) a moment to show up.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let report = check(&written, &seen_amqp(&rabbit.deliveries()));
    // No faults, so no duplicates.
    outbox_tests::check::judge(
        TMP,
        "amqp: no faults, 8 writers x 50 keys",
        &report,
        started,
        Some(0),
    );
    assert_eq!(db.pending().await, 0);

    relay.stop().await;
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// A transaction holds its outbox row uncommitted while later rows commit and
/// are published; once it commits, its row is delivered too (no watermark).
#[tokio::test]
async fn late_commit_with_lower_seq_is_still_delivered() {
    outbox_tests::init_logging();
    let mut db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let relay = InProcessRelay::amqp(&db, fast_settings());
    let outbox = db.outbox();

    let mut slow_client = outbox_tests::db::connect(&db.config).await;
    let slow_tx = slow_client.transaction().await.expect("begin");
    let slow_msg = Message::builder(rabbit.exchange.as_str())
        .key("slow")
        .payload("slow")
        .build()
        .expect("valid");
    let slow_id = outbox
        .enqueue(&slow_tx, &slow_msg)
        .await
        .expect("enqueue slow");

    let mut later = Vec::new();
    for i in 0..20 {
        let tx = db.client.transaction().await.expect("begin");
        let m = Message::builder(rabbit.exchange.as_str())
            .key(format!("fast-{i}"))
            .payload("fast")
            .build()
            .expect("valid");
        later.push(outbox.enqueue(&tx, &m).await.expect("enqueue"));
        tx.commit().await.expect("commit");
    }
    assert!(
        eventually(PATIENCE, || async { rabbit.count() >= 20 }).await,
        "later rows published first"
    );
    // Hold the early transaction open a few seconds longer while the relay keeps polling.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!rabbit
        .deliveries()
        .iter()
        .any(|d| d.message_id == slow_id.to_string()));

    // Its seq is lower than those of the 20 rows already published.
    let slow_seq: i64 = slow_tx
        .query_one(
            &format!("SELECT seq FROM {} WHERE message_id = $1", db.table()),
            &[&slow_id.0],
        )
        .await
        .expect("own row")
        .get(0);
    let highest: i64 = db
        .client
        .query_one(
            &format!("SELECT last_value FROM pg_sequences WHERE schemaname = '{}' AND sequencename = 'messages_seq_seq'", db.schema),
            &[],
        )
        .await
        .expect("sequence")
        .get(0);
    assert!(
        slow_seq < highest,
        "slow row seq {slow_seq} should precede later rows (up to {highest})"
    );
    slow_tx.commit().await.expect("commit slow");
    assert!(
        eventually(PATIENCE, || async {
            rabbit
                .deliveries()
                .iter()
                .any(|d| d.message_id == slow_id.to_string())
        })
        .await,
        "the late-committing row was skipped"
    );
    relay.stop().await;
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// How many distinct messages `rabbit` has received: a batch cut short by
/// a closed channel sends some again.
fn distinct(rabbit: &Fixture) -> usize {
    rabbit
        .message_ids()
        .into_iter()
        .collect::<std::collections::HashSet<_>>()
        .len()
}

/// A destination that routes nowhere: the row is kept with its error, and every
/// other row keeps flowing. Same for an exchange that does not exist.
#[tokio::test]
async fn unroutable_and_missing_exchanges_keep_the_row_and_do_not_block_others() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let unbound = outbox_tests::unique("unbound");
    amqp::declare_unbound_exchange(&unbound).await;
    let missing = outbox_tests::unique("missing");
    let relay = InProcessRelay::amqp(&db, fast_settings());

    let outbox = db.outbox();
    let bad1 = outbox
        .enqueue(
            &db.client,
            &Message::builder(unbound.as_str())
                .key("bad")
                .payload("x")
                .build()
                .expect("valid"),
        )
        .await
        .expect("enqueue");
    let bad2 = outbox
        .enqueue(
            &db.client,
            &Message::builder(missing.as_str())
                .payload("x")
                .build()
                .expect("valid"),
        )
        .await
        .expect("enqueue");
    let good: Vec<Message> = (0..200)
        .map(|i| {
            Message::builder(rabbit.exchange.as_str())
                .key(format!("k{}", i % 10))
                .json(&i)
                .build()
                .expect("valid")
        })
        .collect();
    outbox
        .enqueue_batch(&db.client, &good)
        .await
        .expect("enqueue good");

    assert!(
        eventually(PATIENCE, || async { rabbit.count() >= 200 }).await,
        "good rows blocked"
    );
    let q = format!(
        "SELECT attempts, last_error FROM {} WHERE message_id = $1",
        db.table()
    );
    let check_row = |id: outbox_client::MessageId, expect: &'static str| {
        let q = q.clone();
        let client = &db.client;
        async move {
            eventually(PATIENCE, || {
                let q = q.clone();
                async move {
                    match client.query_opt(&q, &[&id.0]).await.expect("select") {
                        Some(r) => {
                            r.get::<_, i32>(0) >= 1
                                && r.get::<_, Option<String>>(1)
                                    .is_some_and(|e| e.contains(expect))
                        }
                        None => false,
                    }
                }
            })
            .await
        }
    };
    assert!(
        check_row(bad1, "unroutable").await,
        "unroutable row kept with its error"
    );
    assert!(
        check_row(bad2, "does not exist").await,
        "missing-exchange row kept with its error"
    );
    assert_eq!(db.pending().await, 2);

    relay.stop().await;
    amqp::delete_exchange(&unbound).await;
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// An exchange deleted while the relay publishes to it: an auto-delete
/// exchange whose last binding went, a topology torn down and declared
/// again. RabbitMQ answers a publish to it by closing the channel under
/// the rest of the batch. That is an answer about one exchange, not an
/// outage: no batch may fail as one (backing off, reporting the broker
/// down), the exchange's messages wait with an error naming it, and the
/// messages of other exchanges in the same batches are delivered.
#[tokio::test]
async fn an_exchange_deleted_mid_stream_holds_back_only_its_own_messages() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let doomed = outbox_tests::unique("doomed");
    amqp::declare_unbound_exchange(&doomed).await;
    amqp::bind_fixture_queue(&rabbit, &doomed).await;
    let relay = InProcessRelay::amqp(&db, fast_settings());
    let outbox = db.outbox();
    let message = |exchange: &str, key: String, i: usize| {
        Message::builder(exchange)
            .key(key)
            .json(&i)
            .build()
            .expect("valid")
    };
    // Both exchanges used, so the relay has seen both exist.
    let warm_up: Vec<Message> = (0..100)
        .map(|i| {
            let exchange = if i % 2 == 0 {
                &doomed
            } else {
                &rabbit.exchange
            };
            message(exchange, format!("w{}", i % 10), i)
        })
        .collect();
    outbox
        .enqueue_batch(&db.client, &warm_up)
        .await
        .expect("enqueue");
    assert!(
        eventually(PATIENCE, || async { rabbit.count() >= 100 }).await,
        "nothing flows"
    );

    amqp::delete_exchange(&doomed).await;
    // One message in ten for the deleted exchange, spread through every
    // batch.
    let (mut good, mut held) = (0, 0);
    for chunk in 0..10 {
        let stream: Vec<Message> = (0..200)
            .map(|n| {
                let i = chunk * 200 + n;
                if i % 10 == 0 {
                    held += 1;
                    message(&doomed, format!("d{}", i % 3), i)
                } else {
                    good += 1;
                    message(&rabbit.exchange, format!("k{}", i % 20), i)
                }
            })
            .collect();
        outbox
            .enqueue_batch(&db.client, &stream)
            .await
            .expect("enqueue");
    }
    assert!(
        eventually(PATIENCE, || async { distinct(&rabbit) >= 100 + good }).await,
        "{} of {good} messages of the other exchange arrived",
        distinct(&rabbit) - 100
    );
    let named = format!(
        "SELECT count(*) FROM {} WHERE last_error LIKE '%does not exist%'",
        db.table()
    );
    assert!(
        eventually(PATIENCE, || async {
            db.client
                .query_one(&named, &[])
                .await
                .expect("count")
                .get::<_, i64>(0)
                > 0
        })
        .await,
        "no row of the deleted exchange names why it waits"
    );
    // Settles commit after the consumer has the messages.
    assert!(
        eventually(PATIENCE, || async { db.pending().await == held }).await,
        "{} rows wait, {held} of them the deleted exchange's",
        db.pending().await
    );
    let failed = relay
        .stats
        .counted(outbox_relay::health::Event::BatchFailed);
    assert_eq!(
        failed, 0,
        "batches failed as in an outage, though the broker answered about one exchange"
    );
    relay.stop().await;
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// An internal exchange takes no client's publish: RabbitMQ closes the
/// channel with ACCESS_REFUSED ("cannot publish to internal exchange"), as
/// for a missing permission, but no grant will ever let the message
/// through. Before, the relay took it for a permission and held the
/// message, and every later one of its key, for good, without counting an
/// attempt. It is the message's own failure: it counts attempts and ends
/// in the dead letters, naming why, while the other keys flow.
#[tokio::test]
async fn a_message_to_an_internal_exchange_is_dead_lettered_not_held_forever() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let internal = outbox_tests::unique("internal");
    amqp::declare_internal_exchange(&internal).await;
    let settings = outbox_relay::Settings {
        max_attempts: 3,
        retry_base: Duration::from_millis(50),
        retry_max: Duration::from_millis(200),
        ..fast_settings()
    };
    let relay = InProcessRelay::amqp(&db, settings);
    let outbox = db.outbox();
    let mut good = 0;
    for chunk in 0..5 {
        let stream: Vec<Message> = (0..100)
            .map(|n| {
                let i = chunk * 100 + n;
                let exchange = if n == 0 {
                    internal.as_str()
                } else {
                    good += 1;
                    rabbit.exchange.as_str()
                };
                Message::builder(exchange)
                    .key(format!("k{}", i % 7 + if n == 0 { 100 } else { 0 }))
                    .json(&i)
                    .build()
                    .expect("valid")
            })
            .collect();
        outbox
            .enqueue_batch(&db.client, &stream)
            .await
            .expect("enqueue");
    }
    let arrived = eventually(PATIENCE, || async { distinct(&rabbit) >= good }).await;
    let dead_lettered = eventually(Duration::from_secs(60), || async {
        db.count("dead_letters").await == 5 && db.pending().await == 0
    })
    .await;
    let errors: Vec<Option<String>> = db
        .column(&format!(
            "SELECT last_error FROM {}.dead_letters",
            db.schema.quoted()
        ))
        .await;
    let failed = relay
        .stats
        .counted(outbox_relay::health::Event::BatchFailed);
    relay.stop().await;
    assert!(arrived, "{} of {good} delivered", distinct(&rabbit));
    assert!(
        dead_lettered,
        "{} dead letters, {} rows waiting: {:?}",
        db.count("dead_letters").await,
        db.pending().await,
        db.column::<Option<String>>(&format!("SELECT last_error FROM {}", db.table()))
            .await
    );
    assert!(
        errors
            .iter()
            .all(|e| e.as_deref().is_some_and(|e| e.contains("internal"))),
        "{errors:?}"
    );
    assert_eq!(failed, 0, "an internal exchange is no outage");
    amqp::delete_exchange(&internal).await;
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// A destination the relay's user may not write to: a new exchange whose
/// permission was forgotten. RabbitMQ answers a publish there by closing
/// the channel with ACCESS_REFUSED, under every other message of the batch.
/// Only that exchange's messages may wait, with an error naming why; the
/// messages of other exchanges, in the same batches, are delivered, and no
/// batch fails as in an outage.
#[tokio::test]
async fn an_exchange_the_relay_may_not_write_to_holds_back_only_its_own_messages() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let forbidden = outbox_tests::unique("forbidden");
    amqp::declare_unbound_exchange(&forbidden).await;
    amqp::bind_fixture_queue(&rabbit, &forbidden).await;
    // A user that may write to every exchange but that one.
    let user = outbox_tests::unique("relay");
    amqp::rabbitmqctl(&["add_user", &user, "secret"]).await;
    amqp::rabbitmqctl(&[
        "set_permissions",
        "-p",
        "/",
        &user,
        ".*",
        &format!("^(?!{forbidden}$).*"),
        ".*",
    ])
    .await;
    let publisher = AmqpPublisher::new(AmqpSettings {
        url: format!("amqp://{user}:secret@127.0.0.1:5672/%2f"),
        confirm_timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(5),
        ca_pem: None,
    });
    // The default attempts: waiting for a permission counts none, so
    // nothing may reach the dead letters meanwhile.
    let relay = InProcessRelay::with(&db, publisher, fast_settings());
    let outbox = db.outbox();
    let (mut good, mut held) = (0, 0);
    for chunk in 0..10 {
        let stream: Vec<Message> = (0..200)
            .map(|n| {
                let i = chunk * 200 + n;
                let (exchange, key) = if i % 10 == 0 {
                    held += 1;
                    (&forbidden, format!("f{}", i % 3))
                } else {
                    good += 1;
                    (&rabbit.exchange, format!("k{}", i % 20))
                };
                Message::builder(exchange.as_str())
                    .key(key)
                    .json(&i)
                    .build()
                    .expect("valid")
            })
            .collect();
        outbox
            .enqueue_batch(&db.client, &stream)
            .await
            .expect("enqueue");
    }
    let arrived = eventually(PATIENCE, || async { distinct(&rabbit) >= good }).await;
    // Settles commit after the consumer has the messages.
    let settled = eventually(PATIENCE, || async { db.pending().await == held }).await;
    let failed = relay
        .stats
        .counted(outbox_relay::health::Event::BatchFailed);
    let named = format!(
        "SELECT count(*) FROM {} WHERE last_error LIKE '%ACCESS_REFUSED%'",
        db.table()
    );
    let named: i64 = db
        .client
        .query_one(&named, &[])
        .await
        .expect("count")
        .get(0);
    let pending = db.pending().await;
    // Granted, the exchange is tried again (within 30 s) and its messages
    // go.
    amqp::rabbitmqctl(&["set_permissions", "-p", "/", &user, ".*", ".*", ".*"]).await;
    let drained = eventually(PATIENCE, || async { db.pending().await == 0 }).await;
    let all = good + held as usize;
    eventually(PATIENCE, || async { distinct(&rabbit) >= all }).await;
    let delivered = distinct(&rabbit);
    let dead: Vec<Option<String>> = db
        .column(&format!(
            "SELECT last_error FROM {}.dead_letters",
            db.schema.quoted()
        ))
        .await;
    relay.stop().await;
    amqp::rabbitmqctl(&["delete_user", &user]).await;
    amqp::delete_exchange(&forbidden).await;
    assert!(
        arrived,
        "{} of {good} messages of the other exchange arrived",
        distinct(&rabbit)
    );
    assert!(
        settled,
        "{pending} rows waited, {held} of them the forbidden exchange's"
    );
    assert!(named > 0, "no waiting row names why");
    assert_eq!(
        failed, 0,
        "batches failed as in an outage, though the broker answered about one exchange"
    );
    assert!(
        drained && delivered >= all,
        "once granted, the exchange's messages were not all delivered: {delivered} of {all} \
         delivered, {} rows left, {} dead letters: {:?}",
        db.pending().await,
        dead.len(),
        dead.first()
    );
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// With the trigger off, polling alone delivers; with it on, NOTIFY alone does.
#[tokio::test]
async fn notify_switch_and_polling_fallback() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let outbox = db.outbox();
    let m = |i: i32| {
        Message::builder(rabbit.exchange.as_str())
            .json(&i)
            .build()
            .expect("valid")
    };

    // 1. NOTIFY off (the default), short polling: delivered by the poll.
    outbox_client::set_notify(&db.client, db.schema.as_str(), false)
        .await
        .expect("off");
    let polling = InProcessRelay::amqp(&db, fast_settings());
    outbox.enqueue(&db.client, &m(1)).await.expect("enqueue");
    assert!(
        eventually(PATIENCE, || async { rabbit.count() >= 1 }).await,
        "poll did not deliver"
    );
    polling.stop().await;

    // 2. Polling effectively disabled: with NOTIFY off nothing moves...
    let hour = outbox_relay::Settings {
        poll_interval: Duration::from_secs(3600),
        poll_min: Duration::from_secs(3600),
        ..fast_settings()
    };
    let notified = InProcessRelay::amqp(&db, hour);
    // The relay's start-up catch-up claim runs first, once it is ready;
    // wait until it has idled.
    assert!(
        eventually(PATIENCE, || async {
            notified.stats.not_ready_reason().is_none()
        })
        .await,
        "the relay never became ready"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    outbox.enqueue(&db.client, &m(2)).await.expect("enqueue");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        rabbit.count(),
        1,
        "with NOTIFY off and no polling, nothing should wake the relay"
    );

    // 3. ...and switching NOTIFY on wakes it with the next insert (both rows go).
    outbox_client::set_notify(&db.client, db.schema.as_str(), true)
        .await
        .expect("on");
    outbox.enqueue(&db.client, &m(3)).await.expect("enqueue");
    assert!(
        eventually(PATIENCE, || async { rabbit.count() >= 3 }).await,
        "NOTIFY did not wake the relay"
    );

    notified.stop().await;
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// A publisher through a proxy in front of RabbitMQ, for the tests of what
/// a batch given up midway leaves behind.
fn publisher_via(proxy: &Proxy) -> AmqpPublisher {
    AmqpPublisher::new(AmqpSettings {
        url: format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port),
        confirm_timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(20),
        ca_pem: None,
    })
}

fn envelopes(exchange: &str, n: i64) -> Vec<Envelope> {
    outbox_tests::envelopes(exchange, n, n)
}

/// A batch given up while it waits for its confirms (the relay's deadline
/// for it passed) takes its connection with it, so that frames of it still
/// queued there cannot be written after its rows went back to the outbox:
/// what is checked is that the next batch goes out on a new connection.
#[tokio::test]
async fn a_batch_given_up_after_sending_takes_its_connection_with_it() {
    outbox_tests::init_logging();
    let rabbit = Fixture::new().await;
    let proxy = Proxy::start("127.0.0.1:5672").await;
    let publisher = publisher_via(&proxy);
    let batch = envelopes(&rabbit.exchange, 10);
    let warm = publisher.publish(&batch[..1]).await.expect("first batch");
    assert!(warm.iter().all(Result::is_ok), "{warm:?}");
    assert_eq!(proxy.accepted(), 1);
    // Connected, the exchange checked, a channel idle: the next batch is
    // sent at once, and its confirms are two seconds away.
    proxy.delay_answers(Duration::from_secs(2));
    give_up(&publisher, &batch[1..], "confirmed in spite of the delay").await;
    proxy.delay_answers(Duration::ZERO);
    publish_and_count(
        &proxy,
        &publisher,
        &batch[..1],
        2,
        "the batch after one given up after sending went out on the same connection",
    )
    .await;
    publisher.close().await;
    rabbit.cleanup().await;
}

/// Publishes `batch` and gives it up after 500 ms, which it must not outlast.
async fn give_up(publisher: &AmqpPublisher, batch: &[Envelope], answered: &str) {
    let given_up = tokio::time::timeout(Duration::from_millis(500), publisher.publish(batch)).await;
    assert!(given_up.is_err(), "{answered}");
}

/// Publishes `batch`, which must be confirmed whole, and checks that the
/// proxy has accepted `connections` by then.
async fn publish_and_count(
    proxy: &Proxy,
    publisher: &AmqpPublisher,
    batch: &[Envelope],
    connections: u64,
    otherwise: &str,
) {
    let after = publisher.publish(batch).await.expect("batch after");
    assert!(after.iter().all(Result::is_ok), "{after:?}");
    assert_eq!(proxy.accepted(), connections, "{otherwise}");
}

/// A batch given up while the publisher is still connecting has sent
/// nothing: the connection under way is finished for the batches after
/// it, not cut off and started over with each.
#[tokio::test]
async fn a_batch_given_up_while_connecting_leaves_the_connection_to_the_next() {
    outbox_tests::init_logging();
    let rabbit = Fixture::new().await;
    let proxy = Proxy::start("127.0.0.1:5672").await;
    // The handshake's three answers take three seconds.
    proxy.delay_answers(Duration::from_secs(1));
    let publisher = publisher_via(&proxy);
    let batch = envelopes(&rabbit.exchange, 10);
    give_up(&publisher, &batch, "connected in spite of the delay").await;
    proxy.delay_answers(Duration::ZERO);
    publish_and_count(
        &proxy,
        &publisher,
        &batch,
        1,
        "the batch after one given up while connecting connected again",
    )
    .await;
    publisher.close().await;
    rabbit.cleanup().await;
}

/// A row header that RabbitMQ reads itself: `CC` and `BCC` name extra
/// routing keys (sender-selected distribution) and must be arrays, while a
/// row's headers travel as strings, and RabbitMQ closes the channel under
/// the whole batch at one. Only that message may be refused, with an error
/// naming the header; the others, in the same batches, are delivered.
#[tokio::test]
async fn a_header_rabbitmq_reads_as_routing_holds_back_only_its_message() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let relay = InProcessRelay::amqp(&db, fast_settings());
    let outbox = db.outbox();
    let mut good = 0;
    let messages: Vec<Message> = (0..500)
        .map(|i| {
            // A key of its own: its dead letter parks its key's later rows.
            let key = if i == 100 {
                "cc".to_owned()
            } else {
                format!("k{}", i % 10)
            };
            let m = Message::builder(rabbit.exchange.as_str()).key(key).json(&i);
            if i == 100 {
                m.header("CC", "billing").build().expect("valid")
            } else {
                good += 1;
                m.build().expect("valid")
            }
        })
        .collect();
    outbox
        .enqueue_batch(&db.client, &messages)
        .await
        .expect("enqueue");
    let arrived = eventually(PATIENCE, || async { distinct(&rabbit) >= good }).await;
    let failed = relay
        .stats
        .counted(outbox_relay::health::Event::BatchFailed);
    let errors: Vec<Option<String>> = db
        .column(&format!("SELECT DISTINCT last_error FROM {}", db.table()))
        .await;
    let dead: Vec<String> = db
        .column(&format!(
            "SELECT last_error FROM {}.dead_letters",
            db.schema.quoted()
        ))
        .await;
    relay.stop().await;
    assert!(arrived, "{} of {good} arrived", distinct(&rabbit));
    assert_eq!(failed, 0, "batches failed as in an outage: {errors:?}");
    assert!(
        dead.len() == 1 && dead[0].contains("\"CC\""),
        "the message with the header is not the one dead letter, naming it: {dead:?}"
    );
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// A header whose JSON text is far longer than the header: a control
/// character prints as `\u0001`, six bytes for one. Once the row is over
/// 2 KB Postgres stores such headers compressed, and the claim sizes them
/// before reading the row. Sized by their text (270 KB here, over twice
/// RabbitMQ's 128 KiB frame) the row was dead-lettered unread, though its
/// 45 KB fit the frame with room to spare. It must be delivered whole.
#[tokio::test]
async fn a_header_of_control_characters_is_sized_as_sent_not_as_printed() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    const LEN: i32 = 45_000;
    let seq: i64 = db
        .client
        .query_one(
            &format!(
                "INSERT INTO {} (destination, ordering_key, headers, payload) \
                 VALUES ($1, 'k0', jsonb_build_object('bin', repeat(chr(1), $2)), '\\x01') \
                 RETURNING seq",
                db.table()
            ),
            &[&rabbit.exchange, &LEN],
        )
        .await
        .expect("insert the row")
        .get(0);
    // Asked after the insert: RETURNING sees the value before it is stored.
    let stored: Vec<Option<String>> = db
        .column(&format!(
            "SELECT pg_column_compression(headers) FROM {} WHERE seq = {seq}",
            db.table()
        ))
        .await;
    assert!(
        matches!(stored.as_slice(), [Some(_)]),
        "the headers were not stored compressed: {stored:?}"
    );
    let relay = InProcessRelay::amqp(&db, fast_settings());
    let dead_letters = format!("SELECT last_error FROM {}.dead_letters", db.schema.quoted());
    // Either outcome ends the wait: delivered, or refused.
    let settled = eventually(PATIENCE, || async {
        rabbit.count() >= 1 || !db.column::<String>(&dead_letters).await.is_empty()
    })
    .await;
    let arrived = settled && rabbit.count() >= 1;
    let dead: Vec<String> = db.column(&dead_letters).await;
    relay.stop().await;
    assert!(dead.is_empty(), "dead-lettered: {dead:?}");
    assert!(arrived, "not delivered");
    let header = rabbit.deliveries()[0].headers.get("bin").cloned();
    assert_eq!(
        header.map(|h| h.bytes().filter(|&b| b == 1).count()),
        Some(LEN as usize),
        "the header did not arrive whole"
    );
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// README's demo, in a schema of its own: it commits, rolls back, relays,
/// and says ok only when the consumer saw each committed id once.
#[tokio::test]
async fn the_readmes_demo_relays_and_checks_what_arrived() {
    let schema = outbox_tests::unique("demo");
    let (code, stdout, stderr) = outbox_tests::process::cli(
        env!("CARGO_BIN_EXE_outbox-relay-under-test"),
        &schema,
        &["demo"],
    )
    .await;
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("committed 6, received 6 of them, copies 0, unexpected 0"),
        "{stdout}"
    );
    assert!(stdout.contains("\nok: "), "{stdout}");
    let client = outbox_tests::db::connect(&outbox_tests::pg_url().parse().expect("url")).await;
    client
        .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .await
        .expect("drop the demo's schema");
}
