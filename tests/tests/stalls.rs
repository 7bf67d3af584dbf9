//! Loss and stalls under conditions the happy path never shows: returns that
//! arrive out of step with confirms, a hot key whose head is blocked while
//! thousands of its messages wait, and several outboxes on one cluster.
//!
//! Every case here failed against the relay before its fix; see the comment on
//! each test for what it caught.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use outbox_client::{Message, MessageId};
use outbox_tests::amqp::{self, Fixture};
use outbox_tests::db::TestDb;
use outbox_tests::{eventually, fast_settings, InProcessRelay};
use rand::{Rng, SeedableRng};

const PATIENCE: Duration = Duration::from_secs(120);

async fn count(db: &TestDb, table: &str) -> i64 {
    db.client
        .query_one(
            &format!("SELECT count(*) FROM {}.{table}", db.schema.quoted()),
            &[],
        )
        .await
        .expect("count")
        .get(0)
}

async fn ids_in(db: &TestDb, table: &str) -> HashSet<String> {
    db.client
        .query(
            &format!(
                "SELECT message_id::text FROM {}.{table}",
                db.schema.quoted()
            ),
            &[],
        )
        .await
        .expect("ids")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Unroutable and routable messages mixed in pipelined batches on one
/// channel. RabbitMQ sends each `basic.return` before its message's ack, but
/// a later ack (often a `multiple` one) may complete first, so a return must
/// be matched to its message by id, never by arrival order. Before the fix,
/// about one unroutable message in a few thousand was deleted as published.
#[tokio::test]
async fn a_returned_message_is_never_settled_as_published() {
    outbox_tests::init_logging();
    let seed = outbox_tests::seed();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    // The fixture's topic exchange routes "#" to its queue; a direct exchange
    // bound with one routing key makes every other key unroutable.
    let direct = outbox_tests::unique("direct");
    amqp::declare_direct_exchange_bound(&rabbit, &direct, "ok").await;

    let relay = InProcessRelay::amqp(
        &db,
        outbox_relay::Settings {
            batch_size: 250,
            max_attempts: 1,
            park_on_dead_letter: false,
            ..fast_settings()
        },
    );
    let outbox = db.outbox();
    let mut routable = HashSet::new();
    let mut unroutable = HashSet::new();
    let total = 12_000;
    let mut written = 0;
    while written < total {
        let n = rng.random_range(50..400).min(total - written);
        let mut batch = Vec::with_capacity(n);
        for _ in 0..n {
            let bad = rng.random_bool(0.3);
            let id = MessageId::new_v7();
            let m = Message::builder(direct.as_str())
                .message_id(id)
                .routing_key(if bad { "nowhere" } else { "ok" })
                .key(format!("k{}", rng.random_range(0..500)))
                .payload(vec![b'x'; 64])
                .build()
                .expect("valid");
            if bad {
                unroutable.insert(id.to_string());
            } else {
                routable.insert(id.to_string());
            }
            batch.push(m);
        }
        outbox
            .enqueue_batch(&db.client, &batch)
            .await
            .expect("enqueue");
        written += n;
    }
    assert!(
        eventually(PATIENCE, || async { db.pending().await == 0 }).await,
        "seed {seed}: the outbox did not drain"
    );
    relay.stop().await;
    let delivered = || -> HashSet<String> {
        rabbit
            .deliveries()
            .iter()
            .map(|d| d.message_id.clone())
            .collect()
    };
    eventually(Duration::from_secs(30), || async {
        routable.is_subset(&delivered())
    })
    .await;
    let delivered = delivered();
    let missing: Vec<&String> = routable.difference(&delivered).collect();
    assert!(
        missing.is_empty(),
        "seed {seed}: {} routable messages never arrived",
        missing.len()
    );
    let dead = ids_in(&db, "dead_letters").await;
    let lost: Vec<&String> = unroutable.difference(&dead).collect();
    assert!(
        lost.is_empty(),
        "seed {seed}: {} unroutable messages were deleted as published, e.g. {:?}",
        lost.len(),
        lost.first()
    );
    let wrongly_dead: Vec<&String> = routable.intersection(&dead).collect();
    assert!(
        wrongly_dead.is_empty(),
        "seed {seed}: {} routable messages were dead-lettered",
        wrongly_dead.len()
    );
    amqp::delete_exchange(&direct).await;
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// How the head of the hot key is blocked.
#[derive(Debug, Clone, Copy)]
enum Head {
    /// Refused, waiting out a long retry backoff.
    Backoff,
    /// Dead-lettered; its key's later messages are parked behind it.
    Parked,
    /// Dead-lettered; its key's later messages go ahead.
    Skipped,
}

/// One key's head is blocked while 10 × batch_size more of its messages wait
/// behind it; 100 messages of 100 other keys committed afterwards must all go
/// out, and the blocked key's messages must not overtake its head. Before the
/// fix, every claim filled up with the blocked key's rows and returned
/// nothing, so the others waited forever (or until the key drained).
async fn blocked_head_does_not_stall_other_keys(head: Head) {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let missing = outbox_tests::unique("missing"); // never declared
    let batch_size = 100;
    let settings = outbox_relay::Settings {
        batch_size,
        max_attempts: match head {
            Head::Backoff => 100,
            Head::Parked | Head::Skipped => 1,
        },
        // A backoff far longer than the test: the head stays blocked.
        retry_base: Duration::from_secs(3600),
        retry_max: Duration::from_secs(3600),
        park_on_dead_letter: matches!(head, Head::Parked | Head::Backoff),
        ..fast_settings()
    };
    let outbox = db.outbox();
    let head_id = outbox
        .enqueue(
            &db.client,
            &Message::builder(missing.as_str())
                .key("hot")
                .payload(b"head".to_vec())
                .build()
                .expect("valid"),
        )
        .await
        .expect("enqueue");
    let behind: Vec<Message> = (0..10 * batch_size as usize + 500)
        .map(|i| {
            Message::builder(rabbit.exchange.as_str())
                .key("hot")
                .payload(format!("hot-{i}").into_bytes())
                .build()
                .expect("valid")
        })
        .collect();
    outbox
        .enqueue_batch(&db.client, &behind)
        .await
        .expect("enqueue");

    let relay = InProcessRelay::amqp(&db, settings);
    // Let the head be refused first, so the others really come after it.
    assert!(
        eventually(PATIENCE, || async {
            let row = db
                .client
                .query_opt(
                    &format!(
                        "SELECT 1 FROM {} WHERE message_id = $1 AND attempts > 0 \
                         UNION ALL SELECT 1 FROM {}.dead_letters WHERE message_id = $1",
                        db.table(),
                        db.schema.quoted()
                    ),
                    &[&head_id.as_uuid()],
                )
                .await
                .expect("query");
            row.is_some()
        })
        .await,
        "the head was never refused"
    );
    let others: Vec<Message> = (0..100)
        .map(|i| {
            Message::builder(rabbit.exchange.as_str())
                .key(format!("other-{i}"))
                .payload(format!("other-{i}").into_bytes())
                .build()
                .expect("valid")
        })
        .collect();
    let other_ids = outbox
        .enqueue_batch(&db.client, &others)
        .await
        .expect("enqueue");
    let other_ids: HashSet<String> = other_ids.iter().map(|i| i.to_string()).collect();
    let arrived = |rabbit: &Fixture| {
        rabbit
            .deliveries()
            .iter()
            .filter(|d| other_ids.contains(&d.message_id))
            .count()
    };
    assert!(
        eventually(Duration::from_secs(30), || async {
            arrived(&rabbit) == 100
        })
        .await,
        "{head:?}: only {} of 100 other keys' messages arrived",
        arrived(&rabbit)
    );
    let hot_arrived = rabbit
        .deliveries()
        .iter()
        .filter(|d| d.payload.starts_with(b"hot-"))
        .count();
    match head {
        Head::Backoff | Head::Parked => assert_eq!(
            hot_arrived, 0,
            "{head:?}: the hot key's messages overtook its blocked head"
        ),
        Head::Skipped => {
            assert!(
                eventually(PATIENCE, || async {
                    rabbit
                        .deliveries()
                        .iter()
                        .filter(|d| d.payload.starts_with(b"hot-"))
                        .count()
                        >= behind.len()
                })
                .await,
                "skip mode: the hot key's later messages did not go ahead"
            );
            let order: Vec<usize> = rabbit
                .deliveries()
                .iter()
                .filter_map(|d| {
                    std::str::from_utf8(&d.payload)
                        .ok()?
                        .strip_prefix("hot-")?
                        .parse()
                        .ok()
                })
                .collect();
            assert!(
                order.windows(2).all(|w| w[0] < w[1]),
                "skip mode: the hot key's messages arrived out of order"
            );
        }
    }
    relay.stop().await;
    rabbit.cleanup().await;
    db.cleanup().await;
}

#[tokio::test]
async fn a_head_in_backoff_does_not_stall_other_keys() {
    blocked_head_does_not_stall_other_keys(Head::Backoff).await;
}

#[tokio::test]
async fn a_parked_head_does_not_stall_other_keys() {
    blocked_head_does_not_stall_other_keys(Head::Parked).await;
}

#[tokio::test]
async fn a_skipped_dead_letter_does_not_stall_other_keys() {
    blocked_head_does_not_stall_other_keys(Head::Skipped).await;
}

/// Writers keep committing to a key whose head is blocked while others flow:
/// the blocked key's stream must neither stall the others nor get ahead of its
/// head, and every claim stays small (the blocked rows are set aside once).
#[tokio::test]
async fn a_steady_stream_on_a_blocked_key_does_not_stall_others() {
    outbox_tests::init_logging();
    let seed = outbox_tests::seed();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let missing = outbox_tests::unique("missing");
    let relay = InProcessRelay::amqp(
        &db,
        outbox_relay::Settings {
            batch_size: 50,
            max_attempts: 1,
            park_on_dead_letter: true,
            ..fast_settings()
        },
    );
    let outbox = db.outbox();
    outbox
        .enqueue(
            &db.client,
            &Message::builder(missing.as_str())
                .key("hot")
                .payload(b"head".to_vec())
                .build()
                .expect("valid"),
        )
        .await
        .expect("enqueue");
    let mut other_ids = HashSet::new();
    for round in 0..40 {
        let hot: Vec<Message> = (0..rng.random_range(20..80))
            .map(|i| {
                Message::builder(rabbit.exchange.as_str())
                    .key("hot")
                    .payload(format!("hot-{round}-{i}").into_bytes())
                    .build()
                    .expect("valid")
            })
            .collect();
        outbox.enqueue_batch(&db.client, &hot).await.expect("hot");
        let others: Vec<Message> = (0..rng.random_range(1..10))
            .map(|i| {
                Message::builder(rabbit.exchange.as_str())
                    .key(format!("o-{round}-{i}"))
                    .payload(b"other".to_vec())
                    .build()
                    .expect("valid")
            })
            .collect();
        for id in outbox
            .enqueue_batch(&db.client, &others)
            .await
            .expect("others")
        {
            other_ids.insert(id.to_string());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let arrived = || {
        rabbit
            .deliveries()
            .iter()
            .filter(|d| other_ids.contains(&d.message_id))
            .count()
    };
    assert!(
        eventually(Duration::from_secs(30), || async {
            arrived() == other_ids.len()
        })
        .await,
        "seed {seed}: {} of {} other messages arrived",
        arrived(),
        other_ids.len()
    );
    assert!(
        !rabbit
            .deliveries()
            .iter()
            .any(|d| d.payload.starts_with(b"hot-")),
        "seed {seed}: a parked key's message overtook its dead letter"
    );
    relay.stop().await;
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// The replica count and partitions a relay reports through `status --json`.
async fn status(url: &str, schema: &str) -> serde_json::Value {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay-under-test"))
        .args(["status", "--json"])
        .env("OUTBOX_DATABASE_URL", url)
        .env("OUTBOX_SCHEMA", schema)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .expect("run status");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "status is not json ({e}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// One cluster, two databases with the default-named schema each, and a
/// second schema in one of them; one relay per outbox. Advisory locks are per
/// database, but `pg_locks` lists every database's: before the fix each relay
/// counted the other database's relay as a peer, took half the partitions,
/// and half of each outbox's keys never went out.
#[tokio::test]
async fn outboxes_in_other_databases_and_schemas_never_see_each_other() {
    outbox_tests::init_logging();
    let admin = TestDb::new().await;
    let schema = outbox_tests::unique("shared");
    let mut outboxes = Vec::new();
    for db_name in [outbox_tests::unique("db_a"), outbox_tests::unique("db_b")] {
        admin
            .client
            .batch_execute(&format!("CREATE DATABASE {db_name}"))
            .await
            .expect("create database");
        outboxes.push((db_name.clone(), schema.clone()));
    }
    // A second schema beside the first in database A.
    outboxes.push((outboxes[0].0.clone(), outbox_tests::unique("second")));

    let rabbit = Fixture::new().await;
    let mut relays = Vec::new();
    let mut expected = Vec::new();
    for (db_name, schema) in &outboxes {
        let url = format!("postgres://postgres@127.0.0.1:5432/{db_name}");
        let config: tokio_postgres::Config = url.parse().expect("url");
        let mut client = outbox_tests::db::connect(&config).await;
        outbox_client::migrate(&mut client, schema)
            .await
            .expect("migrate");
        let outbox = outbox_client::Outbox::new(schema).expect("schema");
        let msgs: Vec<Message> = (0..640)
            .map(|i| {
                Message::builder(rabbit.exchange.as_str())
                    .key(format!("{db_name}-{schema}-{i}"))
                    .payload(b"x".to_vec())
                    .build()
                    .expect("valid")
            })
            .collect();
        let ids = outbox.enqueue_batch(&client, &msgs).await.expect("enqueue");
        expected.extend(ids.iter().map(|i| i.to_string()));
        let db = TestDb {
            config,
            schema: outbox_client::SchemaName::new(schema).expect("schema"),
            client,
        };
        relays.push(InProcessRelay::amqp(&db, fast_settings()));
        std::mem::forget(db); // dropped with its database below
    }
    let delivered = || {
        let seen: HashSet<String> = rabbit
            .deliveries()
            .iter()
            .map(|d| d.message_id.clone())
            .collect();
        expected.iter().filter(|id| seen.contains(*id)).count()
    };
    assert!(
        eventually(Duration::from_secs(60), || async {
            delivered() == expected.len()
        })
        .await,
        "{} of {} messages delivered",
        delivered(),
        expected.len()
    );
    for (db_name, schema) in &outboxes {
        let url = format!("postgres://postgres@127.0.0.1:5432/{db_name}");
        let s = status(&url, schema).await;
        let replicas = s["replicas"].as_array().expect("replicas");
        assert_eq!(
            replicas.len(),
            1,
            "{db_name}/{schema} sees replicas of other outboxes: {s}"
        );
        assert_eq!(
            replicas[0]["partitions"].as_array().map(Vec::len),
            Some(64),
            "{db_name}/{schema}: {s}"
        );
    }
    for relay in relays {
        relay.stop().await;
    }
    rabbit.cleanup().await;
    for (db_name, _) in outboxes.iter().take(2) {
        let _ = admin
            .client
            .batch_execute(&format!("DROP DATABASE {db_name} WITH (FORCE)"))
            .await;
    }
    admin.cleanup().await;
}

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
        eventually(PATIENCE, || async { count(db, "dead_letters").await == 1 }).await,
        "the refused message was not dead-lettered"
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

/// Returns how many times each payload arrived.
fn tally(rabbit: &Fixture) -> HashMap<Vec<u8>, usize> {
    let mut seen = HashMap::new();
    for d in rabbit.deliveries() {
        *seen.entry(d.payload).or_default() += 1;
    }
    seen
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
    amqp::set_max_message_size(1024 * 1024).await;
    let outbox = db.outbox().max_payload_bytes(4 * 1024 * 1024);
    let mut msgs = Vec::new();
    for i in 0..200u32 {
        let payload = if i == 50 {
            vec![b'z'; 2 * 1024 * 1024]
        } else {
            i.to_be_bytes().to_vec()
        };
        msgs.push(
            Message::builder(rabbit.exchange.as_str())
                .key(format!("k{}", i % 7))
                .payload(payload)
                .build()
                .expect("valid"),
        );
    }
    outbox
        .enqueue_batch(&db.client, &msgs)
        .await
        .expect("enqueue");
    let relay = InProcessRelay::amqp(
        &db,
        outbox_relay::Settings {
            park_on_dead_letter: false,
            ..fast_settings()
        },
    );
    let drained = eventually(Duration::from_secs(60), || async {
        db.pending().await == 0
    })
    .await;
    amqp::set_max_message_size(128 * 1024 * 1024).await;
    assert!(
        drained,
        "the outbox never drained past the oversized message"
    );
    assert_eq!(count(&db, "dead_letters").await, 1);
    let seen = tally(&rabbit);
    assert_eq!(seen.len(), 199, "every other message arrives");
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
    assert_eq!(count(&db, "dead_letters").await, 0, "nothing is refused");
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
