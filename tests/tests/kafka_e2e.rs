//! The whole path to a real Kafka-protocol broker (tansu), read back by an
//! independent consumer.

use std::collections::HashMap;
use std::time::Duration;

use outbox_client::Message;
use outbox_relay::publish::kafka::{KafkaPublisher, KafkaSettings};
use outbox_relay::publish::Publisher;
use outbox_tests::check::{all_seen, check};
use outbox_tests::db::TestDb;
use outbox_tests::kafka::Fixture;
use outbox_tests::process::RelayProcess;
use outbox_tests::proxy::Mode;
use outbox_tests::workload::{self, Spec, Tag};
use outbox_tests::{eventually, fast_settings, kafka_brokers, seen_kafka, InProcessRelay};

const TMP: &str = env!("CARGO_TARGET_TMPDIR");
const RELAY_BIN: &str = env!("CARGO_BIN_EXE_outbox-relay-under-test");
const PATIENCE: Duration = Duration::from_secs(180);

/// 20,000 messages over 200 keys: every id arrives, record key = ordering key,
/// headers as contracted, one partition per key, per-key order as committed.
#[tokio::test]
async fn every_message_keyed_with_headers_in_key_order() {
    let started = std::time::Instant::now();
    outbox_tests::init_logging();
    let brokers = kafka_brokers();
    let kafka = Fixture::new(&brokers, 8).await;
    let db = TestDb::new().await;
    let relay = InProcessRelay::kafka(&db, &brokers, &[], fast_settings());

    let spec = Spec::new(&kafka.topic, 8, 200, 20_000);
    let written = workload::run(&db.config, &db.outbox(), &spec).await;
    assert!(
        eventually(PATIENCE, || async {
            all_seen(&written, &seen_kafka(&kafka.records()))
        })
        .await,
        "only {} records for {} committed messages",
        kafka.count(),
        written.committed.len()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let records = kafka.records();
    let report = check(&written, &seen_kafka(&records));
    outbox_tests::check::judge(
        TMP,
        "kafka: no faults, 20k over 200 keys",
        &report,
        started,
        None,
    );

    let mut partition_of: HashMap<String, i32> = HashMap::new();
    for r in &records {
        let tag: Tag = serde_json::from_slice(&r.payload).expect("payload is a tag");
        assert_eq!(
            r.key.as_deref(),
            Some(tag.key.as_str()),
            "record key = ordering key"
        );
        assert_eq!(
            r.headers.get("content-type").map(String::as_str),
            Some("application/json")
        );
        assert!(r.headers.contains_key("message-id"));
        let p = *partition_of.entry(tag.key.clone()).or_insert(r.partition);
        assert_eq!(p, r.partition, "key {} spread over partitions", tag.key);
    }
    assert!(
        partition_of
            .values()
            .collect::<std::collections::HashSet<_>>()
            .len()
            > 1
    );
    relay.stop().await;
    kafka.stop().await;
    db.cleanup().await;
}

/// A record larger than the producer accepts: its error is recorded, the row
/// stays, and other rows keep flowing.
#[tokio::test]
async fn record_too_large_is_recorded_and_does_not_block() {
    outbox_tests::init_logging();
    let brokers = kafka_brokers();
    let kafka = Fixture::new(&brokers, 2).await;
    let db = TestDb::new().await;
    let relay = InProcessRelay::kafka(&db, &brokers, &[], fast_settings());

    let huge_id = enqueue_too_large(&db, &kafka.topic).await;
    enqueue_small(&db, &kafka.topic, 300).await;

    assert!(
        eventually(PATIENCE, || async { kafka.count() >= 300 }).await,
        "others blocked"
    );
    // Too large can never succeed: the row goes straight to the dead letters
    // with its error, never deleted.
    let q = format!(
        "SELECT attempts, last_error FROM {}.dead_letters WHERE message_id = $1",
        db.schema.quoted()
    );
    assert!(
        eventually(PATIENCE, || async {
            match db
                .client
                .query_opt(&q, &[&huge_id.0])
                .await
                .expect("select")
            {
                Some(r) => {
                    r.get::<_, i32>(0) >= 1
                        && r.get::<_, Option<String>>(1)
                            .is_some_and(|e| e.contains("too large"))
                }
                None => false,
            }
        })
        .await,
        "the oversized row must be kept with its error"
    );
    assert_eq!(db.pending().await, 0);
    relay.stop().await;
    kafka.stop().await;
    db.cleanup().await;
}

/// Enqueues one 2 MiB message for `topic`, over librdkafka's default
/// `message.max.bytes`, and returns its id.
async fn enqueue_too_large(db: &TestDb, topic: &str) -> outbox_client::MessageId {
    let huge = Message::builder(topic)
        .key("big")
        .payload(vec![7u8; 2 << 20])
        .build()
        .expect("valid");
    db.outbox()
        .max_payload_bytes(4 << 20)
        .enqueue(&db.client, &huge)
        .await
        .expect("enqueue")
}

/// A relay process for `db` on `brokers`, with short hold and confirm
/// limits and its metrics on a free port, which it returns.
fn relay_with_metrics(db: &TestDb, brokers: &str) -> (RelayProcess, u16) {
    let port = outbox_tests::free_port();
    let env = [
        ("OUTBOX_SCHEMA", db.schema.to_string()),
        ("OUTBOX_BROKER", "kafka".to_owned()),
        ("OUTBOX_KAFKA_BROKERS", brokers.to_owned()),
        ("OUTBOX_HOLD_LIMIT", "10s".to_owned()),
        ("OUTBOX_CONFIRM_TIMEOUT", "3s".to_owned()),
        ("OUTBOX_HTTP_ADDR", format!("127.0.0.1:{port}")),
    ];
    (RelayProcess::start(RELAY_BIN, &env), port)
}

/// Enqueues `n` small JSON messages for `topic` over seven keys.
async fn enqueue_small(db: &TestDb, topic: &str, n: i32) {
    let small: Vec<Message> = (0..n)
        .map(|i| {
            Message::builder(topic)
                .key(format!("k{}", i % 7))
                .json(&i)
                .build()
                .expect("valid")
        })
        .collect();
    db.outbox()
        .enqueue_batch(&db.client, &small)
        .await
        .expect("enqueue");
}

/// The broker unreachable for 30 s (a proxy refusing every connection) while
/// 16 KiB messages pile up: the relay keeps running with bounded memory, and
/// everything is delivered after recovery.
#[tokio::test]
async fn broker_unreachable_for_30s_memory_bounded_then_delivered() {
    outbox_tests::init_logging();
    // A private broker that advertises the proxy, so every connection librdkafka
    // makes goes through it.
    let (tansu, proxy, brokers) = outbox_tests::process::tansu_behind_proxy().await;
    let kafka = Fixture::new(&brokers, 4).await;
    let db = TestDb::new().await;
    let env = vec![
        ("OUTBOX_SCHEMA", db.schema.to_string()),
        ("OUTBOX_BROKER", "kafka".to_string()),
        ("OUTBOX_KAFKA_BROKERS", brokers.clone()),
        ("OUTBOX_CONFIRM_TIMEOUT", "5s".to_string()),
        ("OUTBOX_HOLD_LIMIT", "30s".to_string()),
        ("OUTBOX_RECONNECT_MAX", "2s".to_string()),
    ];
    let mut relay = RelayProcess::start(RELAY_BIN, &env);

    let outbox = db.outbox();
    let payload = vec![b'p'; 16 * 1024];
    let mut ids = Vec::new();
    let enqueue = |n: usize| -> Vec<Message> {
        (0..n)
            .map(|i| {
                Message::builder(kafka.topic.as_str())
                    .key(format!("k{}", i % 50))
                    .payload(payload.clone())
                    .build()
                    .expect("valid")
            })
            .collect()
    };
    ids.extend(
        outbox
            .enqueue_batch(&db.client, &enqueue(500))
            .await
            .expect("enqueue"),
    );
    assert!(
        eventually(PATIENCE, || async { kafka.count() >= 500 }).await,
        "no flow before the outage"
    );
    let rss_before = relay.rss_kib().expect("relay alive");

    proxy.set(Mode::Refuse);
    let mut peak = rss_before;
    for _ in 0..30 {
        // 5,000 messages of 16 KiB (80 MiB) arrive during the outage.
        ids.extend(
            outbox
                .enqueue_batch(&db.client, &enqueue(167))
                .await
                .expect("enqueue"),
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        peak = peak.max(
            relay
                .rss_kib()
                .expect("relay still running during the outage"),
        );
    }
    let backlog = db.pending().await;
    proxy.set(Mode::Pass);

    assert!(
        eventually(PATIENCE, || async { db.pending().await == 0 }).await,
        "not drained after recovery"
    );
    let unique: std::collections::HashSet<String> = kafka
        .records()
        .iter()
        .filter_map(|r| r.headers.get("message-id").cloned())
        .collect();
    assert!(
        eventually(PATIENCE, || async {
            let seen: std::collections::HashSet<String> = kafka
                .records()
                .iter()
                .filter_map(|r| r.headers.get("message-id").cloned())
                .collect();
            ids.iter().all(|id| seen.contains(&id.to_string()))
        })
        .await,
        "messages lost: {} unique of {}",
        unique.len(),
        ids.len()
    );
    println!(
        "kafka 30s outage: backlog {backlog} rows (~{} MiB) waited in postgres; relay rss {} MiB before, {} MiB peak",
        backlog * 16 / 1024,
        rss_before / 1024,
        peak / 1024
    );
    assert!(backlog > 1000, "the outage should have built a backlog");
    // The relay holds at most its batches in flight plus librdkafka's bounded
    // queue (64 MiB), not the 80 MiB backlog; 256 MiB is a generous ceiling.
    assert!(
        peak < 256 * 1024,
        "relay memory grew to {} MiB during the outage",
        peak / 1024
    );
    relay.signal("TERM").await;
    assert_eq!(relay.wait().await, Some(0));
    kafka.stop().await;
    db.cleanup().await;
    tansu.stop().await;
}

/// The suites judge the relay by what their consumer reads, so the consumer
/// must read every record the broker confirmed. Twelve producers on one
/// partition, each with many requests in flight, is the kind of load under
/// which tansu can make a later offset readable before an earlier one
/// (README, Kafka); a seeded generator picks each producer's record count
/// and linger. The skip itself is rare on an idle machine (none in fifteen
/// runs here); `kafka::tests::a_skipped_range_is_read_again` checks the
/// re-read on a skip made by hand.
#[tokio::test]
async fn the_consumer_reads_every_record_the_broker_confirmed() {
    use rand::{Rng, SeedableRng};
    use rdkafka::producer::{FutureProducer, FutureRecord};

    outbox_tests::init_logging();
    let seed = outbox_tests::seed();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let brokers = kafka_brokers();
    let kafka = Fixture::new(&brokers, 1).await;
    let producers: Vec<(usize, u32)> = (0..12)
        .map(|_| (rng.random_range(1_000..4_000), rng.random_range(0..3)))
        .collect();
    let sends = producers.iter().map(|&(records, linger)| {
        let brokers = brokers.clone();
        let topic = kafka.topic.clone();
        async move {
            let producer: FutureProducer = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                .set("linger.ms", linger.to_string())
                .set("enable.idempotence", "true")
                .create()
                .expect("producer");
            let deliveries: Vec<_> = (0..records)
                .map(|i| {
                    let payload = format!("{topic}-{linger}-{i}");
                    producer
                        .send_result(FutureRecord::<(), _>::to(&topic).payload(&payload))
                        .expect("queued")
                })
                .collect();
            let mut offsets = Vec::new();
            for d in deliveries {
                let delivery = d.await.expect("report").expect("delivered");
                offsets.push((delivery.partition, delivery.offset));
            }
            offsets
        }
    });
    let confirmed: Vec<(i32, i64)> = futures::future::join_all(sends)
        .await
        .into_iter()
        .flatten()
        .collect();
    let last = confirmed.iter().map(|&(_, o)| o).max().expect("records");
    assert!(
        eventually(PATIENCE, || async {
            kafka.records().iter().any(|r| r.offset == last)
        })
        .await,
        "the consumer never reached offset {last}"
    );
    let skipped = outbox_tests::kafka::gaps(&kafka.records());
    let found = kafka.read_skipped().await;
    println!(
        "{} record(s) confirmed; the live consumer skipped {} range(s); {found} found again",
        confirmed.len(),
        skipped.len()
    );
    let read: std::collections::HashSet<(i32, i64)> = kafka
        .records()
        .iter()
        .map(|r| (r.partition, r.offset))
        .collect();
    let missing: Vec<&(i32, i64)> = confirmed.iter().filter(|c| !read.contains(c)).collect();
    assert!(
        missing.is_empty(),
        "{} confirmed record(s) never read, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    kafka.stop().await;
}

/// On a link that answers at once, a new producer's first batch does not
/// wait for librdkafka's first statistics, which alone say that it has its
/// id: they come a whole interval after the producer was created (500 ms
/// by default, most of a new relay's start). Here the interval is ten
/// minutes, so a batch that waited for them would come back unsent after
/// half its 60 s; the one that takes the id as on its way goes out.
#[tokio::test]
async fn a_new_producer_on_a_quick_link_does_not_wait_for_its_first_statistics() {
    outbox_tests::init_logging();
    let brokers = kafka_brokers();
    let kafka = Fixture::new(&brokers, 1).await;
    let publisher = KafkaPublisher::new(KafkaSettings {
        brokers: brokers.clone(),
        properties: vec![("statistics.interval.ms".into(), "600000".into())],
        message_timeout: Duration::from_secs(120),
        in_flight: Default::default(),
    })
    .expect("producer");
    let batch = outbox_tests::envelopes(&kafka.topic, 10, 3);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let sent = publisher
        .publish_until(&batch, deadline)
        .await
        .expect("the first batch went out before the first statistics");
    assert!(sent.iter().all(Result::is_ok), "{sent:?}");
    assert!(eventually(PATIENCE, || async { kafka.count() >= batch.len() }).await);
    publisher.close().await;
    kafka.stop().await;
}

/// A batch that must give up before the producer has its id and its
/// topic's partitions hands librdkafka nothing: it comes back unsent, not
/// timed out in librdkafka's queue, and the set-up goes on for the batches
/// after it. Through a proxy that brings every answer back a second late,
/// the set-up's round trips (connection, producer id, partitions) take
/// longer than the first batch may wait.
#[tokio::test]
async fn a_batch_before_the_producer_is_set_up_comes_back_unsent() {
    outbox_tests::init_logging();
    let (tansu, proxy, brokers) = outbox_tests::process::tansu_behind_proxy().await;
    let kafka = Fixture::new(&brokers, 1).await;
    proxy.delay_answers(Duration::from_secs(1));
    let publisher = KafkaPublisher::new(KafkaSettings {
        brokers: brokers.clone(),
        properties: Vec::new(),
        message_timeout: Duration::from_secs(3),
        in_flight: Default::default(),
    })
    .expect("producer");
    let batch = outbox_tests::envelopes(&kafka.topic, 10, 3);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    let first = publisher.publish_until(&batch, deadline).await;
    match &first {
        Err(e) => assert!(e.is_unsent(), "the first batch failed: {e}"),
        Ok(v) => panic!("the first batch was answered within a second: {v:?}"),
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let next = publisher
        .publish_until(&batch, deadline)
        .await
        .expect("the batch after waited for the set-up and went out");
    assert!(next.iter().all(Result::is_ok), "{next:?}");
    assert!(eventually(PATIENCE, || async { kafka.count() >= batch.len() }).await);
    // Nothing of the batch given back reaches the broker later: the
    // consumer reads each record once.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        kafka.count(),
        batch.len(),
        "records of the batch given back reached the broker"
    );
    publisher.close().await;
    kafka.stop().await;
    tansu.stop().await;
}

/// A row for a topic that does not exist (a typo in a destination, a topic
/// not created yet) is refused on its own with an error naming the topic,
/// and counts its attempts. Handed to librdkafka, such a record waited out
/// the message timeout (`topic.metadata.propagation.max.ms` is 30 s) and
/// came back "timed out": the row was taken for unanswered, retried with no
/// attempt counted, and its error named no topic. Neither its batch nor
/// the broker's health may suffer for it.
#[tokio::test]
async fn a_row_for_a_topic_that_does_not_exist_is_refused_alone() {
    outbox_tests::init_logging();
    let brokers = kafka_brokers();
    let kafka = Fixture::new(&brokers, 2).await;
    let db = TestDb::new().await;
    let (mut relay, port) = relay_with_metrics(&db, &brokers);
    let missing = outbox_tests::unique("missing");
    let outbox = db.outbox();
    // A key of its own: a key's later rows wait behind a refused one.
    let stray = Message::builder(missing.as_str())
        .key("stray")
        .json(&"stray")
        .build()
        .expect("valid");
    let stray_id = outbox.enqueue(&db.client, &stray).await.expect("enqueue");
    enqueue_small(&db, &kafka.topic, 200).await;
    assert!(
        eventually(PATIENCE, || async { kafka.count() >= 200 }).await,
        "the rows for the topic that exists were held up"
    );
    let q = format!(
        "SELECT attempts, last_error FROM {} WHERE message_id = $1",
        db.table()
    );
    let stray_row = || async {
        let row = db
            .client
            .query_opt(&q, &[&stray_id.0])
            .await
            .expect("select");
        row.map(|r| (r.get::<_, i32>(0), r.get::<_, Option<String>>(1)))
    };
    assert!(
        eventually(PATIENCE, || async {
            stray_row().await.is_some_and(|(_, e)| e.is_some())
        })
        .await,
        "the stray row was never tried"
    );
    let metrics = outbox_tests::http::scrape(port).await;
    let failed = outbox_tests::http::sample(&metrics, "outbox_batch_failures_total");
    assert_eq!(
        failed,
        Some(0.0),
        "a batch failed as a whole (the broker looked down) for one row's topic: {:?}",
        stray_row().await
    );
    let (attempts, error) = stray_row().await.expect("the stray row waits");
    let error = error.unwrap_or_default();
    assert!(
        attempts >= 1 && error.contains(&missing) && error.contains("does not exist"),
        "the stray row was not refused with an error naming its topic: {attempts} attempt(s), {error}"
    );
    relay.signal("TERM").await;
    assert_eq!(relay.wait().await, Some(0), "clean exit on SIGTERM");
    kafka.stop().await;
    db.cleanup().await;
}

/// Rows for topics no Kafka broker can have: a name longer than librdkafka
/// takes (512 bytes), and names outside Kafka's rules (249 bytes of
/// `a-z A-Z 0-9 . _ -`), as a writer gets from an exchange-style name
/// (`orders:created`) or a column mixed up in a plain INSERT. Each is
/// refused for good with an error naming its topic, and neither its batch
/// nor the other rows may suffer for it: no batch fails as a whole (the
/// broker looking down), and every other row arrives.
#[tokio::test]
async fn a_row_for_a_topic_name_kafka_cannot_have_is_dead_lettered_alone() {
    outbox_tests::init_logging();
    let brokers = kafka_brokers();
    let kafka = Fixture::new(&brokers, 2).await;
    let db = TestDb::new().await;
    let (mut relay, port) = relay_with_metrics(&db, &brokers);
    let outbox = db.outbox();
    let bad = [
        "t".repeat(600),
        "u".repeat(250),
        "orders:created".to_owned(),
        "orders created".to_owned(),
        "..".to_owned(),
    ];
    let mut ids = Vec::new();
    for (i, topic) in bad.iter().enumerate() {
        // Each between rows that are fine, in the same batches.
        enqueue_small(&db, &kafka.topic, 40).await;
        let m = Message::builder(topic.as_str())
            .key(format!("bad{i}"))
            .json(&i)
            .build()
            .expect("valid");
        ids.push(outbox.enqueue(&db.client, &m).await.expect("enqueue"));
    }
    enqueue_small(&db, &kafka.topic, 40).await;
    // A row leaves the outbox once the broker has confirmed it.
    let left = format!("SELECT count(*) FROM {} WHERE destination = $1", db.table());
    let waiting = || async {
        let row = db
            .client
            .query_one(&left, &[&kafka.topic])
            .await
            .expect("count");
        row.get::<_, i64>(0)
    };
    assert!(
        eventually(PATIENCE, || async { waiting().await == 0 }).await,
        "the rows for the topic that exists were held up: {} of 240 still waiting",
        waiting().await
    );
    assert!(
        eventually(PATIENCE, || async {
            kafka.read_skipped().await;
            kafka.count() >= 240
        })
        .await,
        "{} of the 240 confirmed records read back",
        kafka.count()
    );
    let q = format!(
        "SELECT last_error FROM {}.dead_letters WHERE message_id = $1",
        db.schema.quoted()
    );
    for (topic, id) in bad.iter().zip(&ids) {
        let error = || async {
            db.client
                .query_opt(&q, &[&id.0])
                .await
                .expect("select")
                .and_then(|r| r.get::<_, Option<String>>(0))
        };
        assert!(
            eventually(PATIENCE, || async { error().await.is_some() }).await,
            "the row for {topic:?} is not a dead letter"
        );
        let error = error().await.unwrap_or_default();
        assert!(
            error.contains(&topic[..topic.len().min(40)]) && error.contains("topic name"),
            "the dead letter for {topic:?} does not name its topic: {error}"
        );
    }
    let metrics = outbox_tests::http::scrape(port).await;
    let failed = outbox_tests::http::sample(&metrics, "outbox_batch_failures_total");
    assert_eq!(
        failed,
        Some(0.0),
        "a batch failed as a whole (the broker looked down) for one row's topic name"
    );
    assert_eq!(db.pending().await, 0);
    relay.signal("TERM").await;
    assert_eq!(relay.wait().await, Some(0), "clean exit on SIGTERM");
    kafka.stop().await;
    db.cleanup().await;
}

/// librdkafka's local queue passed through far smaller than the window
/// (100 records against 3 batches of 500): a record that finds it full
/// waits for room, and every record goes once. Before, QUEUE_FULL failed
/// the batch as an outage mid-way, and the retry sent its first records,
/// already queued, again.
#[tokio::test]
async fn a_producer_queue_smaller_than_the_window_makes_records_wait_not_repeat() {
    let started = std::time::Instant::now();
    outbox_tests::init_logging();
    let brokers = kafka_brokers();
    let kafka = Fixture::new(&brokers, 8).await;
    let db = TestDb::new().await;
    let mut spec = Spec::new(&kafka.topic, 4, 200, 20_000);
    spec.rollback_percent = 0;
    spec.max_per_tx = 500;
    spec.max_commit_delay = Duration::ZERO;
    let written = workload::run(&db.config, &db.outbox(), &spec).await;
    let relay = InProcessRelay::kafka(
        &db,
        &brokers,
        &[("queue.buffering.max.messages", "100")],
        fast_settings(),
    );
    assert!(
        eventually(PATIENCE, || async {
            all_seen(&written, &seen_kafka(&kafka.records()))
        })
        .await,
        "only {} records for {} committed messages",
        kafka.count(),
        written.committed.len()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let report = check(&written, &seen_kafka(&kafka.records()));
    outbox_tests::check::judge(
        TMP,
        "kafka: a 100-record producer queue under 3 x 500",
        &report,
        started,
        Some(0),
    );
    relay.stop().await;
    kafka.stop().await;
    db.cleanup().await;
}

/// A property librdkafka refuses (here a misspelt `sasl.password`) stops
/// `run` at start-up as a usage error (exit 2, as README says for a value
/// that cannot be used), naming the property and never its value: it was
/// exit 1, with rdkafka's message ending in the value, the password.
#[tokio::test]
async fn a_property_librdkafka_refuses_is_a_usage_error_that_hides_its_value() {
    let db = TestDb::new().await;
    let (code, _, stderr) = outbox_tests::process::cli(
        RELAY_BIN,
        db.schema.as_str(),
        &[
            "run",
            "--broker",
            "kafka",
            "--kafka-config",
            "sasl.pasword=S3cret-pw",
        ],
    )
    .await;
    assert_eq!(code, Some(2), "a usage error: {stderr}");
    assert!(stderr.contains("sasl.pasword"), "{stderr}");
    assert!(!stderr.contains("S3cret-pw"), "{stderr}");
    db.cleanup().await;
}

/// A row too large to send goes to the dead letters without a batch
/// settling it, and `outbox_messages_total{result="dead_lettered"}`
/// (which the dead-letter alert watches) counts it: it counted only rows
/// a broker had answered.
#[tokio::test]
async fn a_row_dead_lettered_unsent_is_counted_in_the_metrics() {
    outbox_tests::init_logging();
    let brokers = kafka_brokers();
    let kafka = Fixture::new(&brokers, 2).await;
    let db = TestDb::new().await;
    let (relay, port) = relay_with_metrics(&db, &brokers);
    enqueue_too_large(&db, &kafka.topic).await;
    let dead = |metrics: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| {
                l.starts_with("outbox_messages_total{")
                    && l.contains(&format!("destination=\"{}\"", kafka.topic))
                    && l.contains("result=\"dead_lettered\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    assert!(
        eventually(PATIENCE, || async { db.pending().await == 0 }).await,
        "the row never left the outbox"
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            dead(&outbox_tests::http::scrape(port).await) >= 1.0
        })
        .await,
        "no dead_lettered count for {}",
        kafka.topic
    );
    assert_eq!(dead(&outbox_tests::http::scrape(port).await), 1.0);
    drop(relay);
    kafka.stop().await;
    db.cleanup().await;
}
