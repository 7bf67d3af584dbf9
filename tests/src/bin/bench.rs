//! `cargo run --release -p outbox-tests --bin bench -- [--messages N] [--keys K]
//! [--rounds R] [--replicas N]`
//!
//! Measures, in one run on this machine:
//! 1. `enqueue_batch` into the outbox (1 KiB payloads, 1,000 per statement);
//! 2. a raw lapin publisher (persistent, mandatory, confirms) with the relay's
//!    confirm window: `pipeline` tasks each sending `batch` messages then
//!    awaiting their confirms — the ceiling for any relay on this broker. It
//!    sends messages of the shape the relay sends (same payload, routing key
//!    and properties), and the run fails if the broker saw two shapes: the
//!    broker's cost per message depends on its size;
//! 3. the relay draining the same number of messages from a backlog.
//!
//! `--broker kafka` measures a raw idempotent rdkafka producer with the
//! relay's producer settings, the relay draining as many rows to Kafka, and
//! the relay draining them to a broker that answers at once (its in-memory
//! publisher): the relay and Postgres with no broker to wait on.
//!
//! `--broker memory` instead measures the relay process's peak RSS while it
//! drains backlogs of 1 KiB, 100 KiB, 1 MiB and mixed payloads to RabbitMQ,
//! against the same process idle (it runs `outbox-relay` from
//! `cargo build --release -p outbox-relay`).
//!
//! With `--rounds R`, steps 2 and 3 alternate R times and the median is
//! reported (each round's pair goes to stderr); `--replicas N` drains the
//! backlog once more with 2..=N replicas (default 3).
//!
//! Figures are reported as msgs/s and as a ratio to the raw publisher, since
//! absolute numbers move with whatever else the machine is doing.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::{join_all, Either};
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeleteOptions, QueueDeclareOptions,
    QueueDeleteOptions, QueuePurgeOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties};
use outbox_client::Message;
use outbox_tests::cpu::CpuWatch;
use outbox_tests::db::TestDb;

/// Routing key and content type of every benchmark message, whoever sends it.
const ROUTING_KEY: &str = "bench";
const CONTENT_TYPE: &str = "application/octet-stream";

struct Args {
    broker: String,
    messages: usize,
    keys: usize,
    batch: usize,
    pipeline: usize,
    rounds: usize,
    replicas: usize,
    /// Backlog sizes for `--broker backlog`.
    sizes: Vec<usize>,
    /// `--broker backlog`: a CHECKPOINT between filling and draining.
    checkpoint: bool,
}

fn parse_args() -> Args {
    let mut a = Args {
        broker: "amqp".to_owned(),
        messages: 100_000,
        keys: 10_000,
        batch: 500,
        pipeline: 3,
        rounds: 1,
        replicas: 3,
        sizes: vec![10_000, 100_000, 1_000_000],
        checkpoint: false,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        if argv[i] == "--broker" {
            match argv.get(i + 1).map(String::as_str) {
                Some(b @ ("amqp" | "kafka" | "all" | "memory" | "backlog")) => {
                    a.broker = b.to_owned()
                }
                _ => {
                    eprintln!("--broker takes amqp, kafka, all, memory or backlog");
                    std::process::exit(2);
                }
            }
            i += 2;
            continue;
        }
        if argv[i] == "--checkpoint" {
            a.checkpoint = true;
            i += 1;
            continue;
        }
        if argv[i] == "--sizes" {
            let sizes: Option<Vec<usize>> = argv.get(i + 1).and_then(|v| {
                v.split(',')
                    .map(|n| n.trim().replace('_', "").parse().ok())
                    .collect()
            });
            match sizes {
                Some(sizes) if !sizes.is_empty() => a.sizes = sizes,
                _ => {
                    eprintln!("--sizes takes backlog sizes separated by commas, e.g. 10000,100000");
                    std::process::exit(2);
                }
            }
            i += 2;
            continue;
        }
        let v = argv.get(i + 1).and_then(|s| s.parse::<usize>().ok());
        match (argv[i].as_str(), v) {
            ("--messages", Some(v)) => a.messages = v,
            ("--keys", Some(v)) => a.keys = v,
            ("--batch", Some(v)) => a.batch = v,
            ("--pipeline", Some(v)) => a.pipeline = v,
            ("--rounds", Some(v)) if v > 0 => a.rounds = v,
            ("--replicas", Some(v)) if v > 0 => a.replicas = v,
            (other, _) => {
                eprintln!("usage: bench [--broker amqp|kafka|all|memory|backlog] [--sizes N,N,...] [--checkpoint] [--messages N] [--keys K] [--batch B] [--pipeline P] [--rounds R] [--replicas N] (bad: {other})");
                std::process::exit(2);
            }
        }
        i += 2;
    }
    a
}

/// The programs whose CPU a Kafka phase reports: Postgres's processes,
/// the broker, and the bench's own process (the producer or the relay).
const KAFKA_PROGRAMS: [&str; 3] = ["postgres", "tansu", "self"];
/// The same for RabbitMQ (its Erlang VM).
const AMQP_PROGRAMS: [&str; 3] = ["postgres", "beam.smp", "self"];
/// A backlog drain's: the relay runs as a process of its own there, and
/// the bench's process is the consumer.
const BACKLOG_PROGRAMS: [&str; 4] = ["postgres", "beam.smp", "outbox-relay", "self"];

fn rate(n: usize, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = parse_args();
    println!(
        "messages={} payload=1KiB keys={} batch={} pipeline={}",
        args.messages, args.keys, args.batch, args.pipeline
    );
    if args.broker == "amqp" || args.broker == "all" {
        amqp(&args).await?;
    }
    if args.broker == "kafka" || args.broker == "all" {
        kafka(&args).await?;
    }
    if args.broker == "memory" {
        memory().await?;
    }
    if args.broker == "backlog" {
        backlog(&args).await?;
    }
    Ok(())
}

/// Messages for the outbox: 1 KiB payloads over `keys` keys.
async fn fill_outbox(db: &TestDb, destination: &str, args: &Args) -> anyhow::Result<f64> {
    fill_outbox_to(db, destination, ROUTING_KEY, args).await
}

/// [`fill_outbox`] with a routing key of the caller's.
async fn fill_outbox_to(
    db: &TestDb,
    destination: &str,
    routing_key: &str,
    args: &Args,
) -> anyhow::Result<f64> {
    let payload = vec![b'x'; 1024];
    let outbox = db.outbox();
    let started = Instant::now();
    let mut written = 0;
    while written < args.messages {
        let n = 1000.min(args.messages - written);
        let batch: Vec<Message> = (written..written + n)
            .map(|i| {
                Message::builder(destination)
                    .key(format!("key-{}", i % args.keys.max(1)))
                    .routing_key(routing_key)
                    .content_type(CONTENT_TYPE)
                    .payload(payload.clone())
                    .build()
            })
            .collect::<Result<_, _>>()?;
        outbox.enqueue_batch(&db.client, &batch).await?;
        written += n;
    }
    let rate = rate(written, started.elapsed());
    db.client
        .batch_execute(&format!("VACUUM ANALYZE {}", db.table()))
        .await?;
    Ok(rate)
}

fn relay_settings(args: &Args) -> outbox_relay::Settings {
    outbox_relay::Settings {
        batch_size: args.batch as i64,
        pipeline: args.pipeline,
        ..outbox_relay::Settings::default()
    }
}

/// Runs `args.pipeline` tasks side by side, each sending its share of
/// `args.messages` in chunks of `args.batch`: `send(task, sent, n)` sends one
/// chunk and waits for its confirms. Returns msgs/s.
async fn fan_out<F, Fut>(args: &Args, send: F) -> anyhow::Result<f64>
where
    F: Fn(usize, usize, usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let per_task = args.messages / args.pipeline;
    let batch = args.batch;
    let started = Instant::now();
    let tasks: Vec<_> = (0..args.pipeline)
        .map(|t| {
            let send = send.clone();
            tokio::spawn(async move {
                let mut sent = 0;
                while sent < per_task {
                    let n = batch.min(per_task - sent);
                    send(t, sent, n).await?;
                    sent += n;
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for t in tasks {
        t.await??;
    }
    Ok(rate(per_task * args.pipeline, started.elapsed()))
}

async fn drain_with(
    relays: Vec<outbox_tests::InProcessRelay>,
    messages: usize,
    started: Instant,
) -> f64 {
    let published = |rs: &[outbox_tests::InProcessRelay]| {
        rs.iter()
            .map(|r| r.stats.counted(outbox_relay::health::Event::Published))
            .sum::<u64>()
    };
    let mut first = None;
    while published(&relays) < messages as u64 {
        if first.is_none() && published(&relays) > 0 {
            first = Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    eprintln!("first batch settled after {:?}", first);
    let r = rate(messages, started.elapsed());
    for relay in relays {
        relay.stop().await;
    }
    r
}

/// From a relay's metrics: its claims' count and total seconds, its
/// batches' count and total seconds at the broker, then the claims' total
/// seconds until their rows were locked and the settles' total seconds.
fn batch_timings(metrics: &str) -> [f64; 6] {
    [
        "outbox_claim_seconds_count",
        "outbox_claim_seconds_sum",
        "outbox_publish_seconds_count",
        "outbox_publish_seconds_sum",
        "outbox_claim_locking_seconds_sum",
        "outbox_settle_seconds_sum",
    ]
    .map(|name| outbox_tests::http::sample(metrics, name).unwrap_or(0.0))
}

/// Raw idempotent producer versus the relay, to tansu (or any Kafka-protocol
/// broker at OUTBOX_TEST_KAFKA_BROKERS).
async fn kafka(args: &Args) -> anyhow::Result<()> {
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
    let brokers = outbox_tests::kafka_brokers();
    let raw_topic = outbox_tests::unique("benchraw");
    let relay_topic = outbox_tests::unique("benchrelay");
    outbox_tests::kafka::create_topic(&brokers, &raw_topic, 8).await;
    outbox_tests::kafka::create_topic(&brokers, &relay_topic, 8).await;
    let payload = vec![b'x'; 1024];

    // The relay's own producer settings, so only the relay's work differs.
    let settings = outbox_relay::publish::kafka::KafkaSettings {
        brokers: brokers.clone(),
        properties: Vec::new(),
        message_timeout: Duration::from_secs(30),
        in_flight: outbox_relay::publish::kafka::InFlight {
            pipeline: args.pipeline,
            batch_size: args.batch,
            ..Default::default()
        },
    };
    let producer: FutureProducer = settings.client_config().create()?;
    let window = args.batch * args.pipeline;
    // Where each phase's CPU goes: the drain shares the machine's cores
    // with Postgres and tansu, the raw producer only with tansu.
    let watch = CpuWatch::start(&KAFKA_PROGRAMS);
    let started = Instant::now();
    let mut sent = 0;
    while sent < args.messages {
        let n = window.min(args.messages - sent);
        let mut reports = Vec::with_capacity(n);
        for i in sent..sent + n {
            let key = format!("key-{}", i % args.keys.max(1));
            let id = uuid::Uuid::now_v7().to_string();
            let record = FutureRecord::to(&raw_topic)
                .key(key.as_bytes())
                .payload(&payload)
                // The headers the relay sets for a row without its own.
                .headers(
                    OwnedHeaders::new()
                        .insert(Header {
                            key: "message-id",
                            value: Some(id.as_str()),
                        })
                        .insert(Header {
                            key: "content-type",
                            value: Some(CONTENT_TYPE),
                        }),
                );
            reports.push(producer.send_result(record).map_err(|(e, _)| e)?);
        }
        for r in join_all(reports).await {
            if !matches!(r, Ok(Ok(_))) {
                anyhow::bail!("raw kafka produce failed");
            }
        }
        sent += n;
    }
    let raw = rate(sent, started.elapsed());
    let raw_cpu = watch.stop().await;
    producer.flush(Duration::from_secs(10))?;

    let db = TestDb::new().await;
    outbox_client::set_notify(&db.client, db.schema.as_str(), false).await?;
    fill_outbox(&db, &relay_topic, args).await?;
    // OUTBOX_BENCH_TRACE=1: the relay's claim and broker times over the
    // drain, from its own histograms (recorded in this process).
    let recorder = std::env::var_os("OUTBOX_BENCH_TRACE")
        .and_then(|_| outbox_relay::metrics::install("kafka").ok());
    let watch = CpuWatch::start(&KAFKA_PROGRAMS);
    let started = Instant::now();
    let relay = outbox_tests::InProcessRelay::kafka(&db, &brokers, &[], relay_settings(args));
    let drain = drain_with(vec![relay], args.messages, started).await;
    let drain_cpu = watch.stop().await;
    let traced = recorder.as_ref().map(|h| batch_timings(&h.render()));
    if let Some(after) = traced {
        print_trace(after, [0.0; 6], args.messages as f64 / drain);
    }
    db.cleanup().await;

    // The same drain to a broker that answers at once (the in-memory
    // publisher): what the relay and Postgres reach with no broker to wait
    // on, on the same cores, so the Kafka drain's gap to it is the broker's
    // share and its gap to the raw producer the rest.
    let db = TestDb::new().await;
    outbox_client::set_notify(&db.client, db.schema.as_str(), false).await?;
    fill_outbox(&db, &relay_topic, args).await?;
    let watch = CpuWatch::start(&KAFKA_PROGRAMS);
    let started = Instant::now();
    let relay = outbox_tests::InProcessRelay::with(
        &db,
        outbox_relay::publish::memory::MemoryPublisher::counting(),
        relay_settings(args),
    );
    let answered = relay.publisher::<outbox_relay::publish::memory::MemoryPublisher>();
    let instant = drain_with(vec![relay], args.messages, started).await;
    let instant_cpu = watch.stop().await;
    anyhow::ensure!(
        answered.accepted() >= args.messages,
        "the broker answering at once took {} of {} messages",
        answered.accepted(),
        args.messages
    );
    if let (Some(h), Some(before)) = (&recorder, traced) {
        print_trace(
            batch_timings(&h.render()),
            before,
            args.messages as f64 / instant,
        );
    }
    db.cleanup().await;
    println!("{:<44} {:>10} {:>8}", "kafka (tansu)", "msgs/s", "vs raw");
    println!(
        "{:<44} {:>10.0} {:>8}",
        "raw rdkafka producer (idempotent, acks=all)", raw, "1.00"
    );
    println!(
        "{:<44} {:>10.0} {:>8.2}",
        "relay drain to kafka",
        drain,
        drain / raw
    );
    println!(
        "{:<44} {:>10.0} {:>8.2}",
        "relay drain to a broker answering at once",
        instant,
        instant / raw
    );
    println!(
        "raw producer (self: the producer): {}",
        raw_cpu.per_message(sent)
    );
    println!(
        "relay drain (self: the relay): {}",
        drain_cpu.per_message(args.messages)
    );
    println!(
        "relay drain, broker answering at once (self: the relay): {}",
        instant_cpu.per_message(args.messages)
    );
    Ok(())
}

/// Prints a drain's claims, their locking part, its batches at the broker
/// and their settles, from the relay's histograms read after the drain
/// (`after`) less what they held before it (`before`), over `secs`.
fn print_trace(after: [f64; 6], before: [f64; 6], secs: f64) {
    let [claims, claim_s, batches, publish_s, locking_s, settle_s]: [f64; 6] =
        std::array::from_fn(|i| after[i] - before[i]);
    let ms_each = |sum: f64, n: f64| sum / n.max(1.0) * 1000.0;
    eprintln!(
        "  {claims:.0} claims of {:.2} ms ({:.0} % of the drain), {:.2} ms of each until its rows were locked ({:.0} %); \
         {batches:.0} batches at the broker for {:.2} ms ({:.0} %), then settled in {:.2} ms ({:.0} %)",
        ms_each(claim_s, claims),
        claim_s / secs * 100.0,
        ms_each(locking_s, claims),
        locking_s / secs * 100.0,
        ms_each(publish_s, batches),
        publish_s / secs * 100.0,
        ms_each(settle_s, batches),
        settle_s / secs * 100.0,
    );
}

async fn amqp(args: &Args) -> anyhow::Result<()> {
    let payload = vec![b'x'; 1024];
    let exchange = outbox_tests::unique("bench");
    let queue = outbox_tests::unique("benchq");

    let conn =
        Connection::connect(&outbox_tests::amqp_url(), ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    outbox_tests::amqp::declare_topology(&ch, &exchange, &queue).await?;

    // 1. Rounds of the raw lapin baseline (the relay's confirm window) and the
    // relay draining a backlog with one replica.
    let pub_ch = Arc::new(conn.create_channel().await?);
    pub_ch
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let db = TestDb::new().await;
    outbox_client::set_notify(&db.client, db.schema.as_str(), false).await?;
    // Rounds alternate the baseline and the 1-replica drain, so each ratio
    // compares two runs seconds apart on the same machine.
    let mut rounds = Vec::new();
    let mut enqueue = 0.0;
    for round in 0..args.rounds {
        let watch = CpuWatch::start(&AMQP_PROGRAMS);
        let raw = raw_lapin(args, &pub_ch, &exchange, &payload).await?;
        let raw_cpu = watch.stop().await;
        let raw_shape = shape(&ch, &queue).await?;
        ch.queue_purge(queue.as_str().into(), QueuePurgeOptions::default())
            .await?;
        enqueue = fill_outbox(&db, &exchange, args).await?;
        let watch = CpuWatch::start(&AMQP_PROGRAMS);
        let started = Instant::now();
        let relay = outbox_tests::InProcessRelay::amqp(&db, relay_settings(args));
        let drain = drain_with(vec![relay], args.messages, started).await;
        let drain_cpu = watch.stop().await;
        let relay_shape = shape(&ch, &queue).await?;
        if raw_shape != relay_shape {
            anyhow::bail!(
                "the baseline and the relay sent different messages:\n  raw:   {raw_shape}\n  relay: {relay_shape}"
            );
        }
        ch.queue_purge(queue.as_str().into(), QueuePurgeOptions::default())
            .await?;
        eprintln!(
            "round {}: raw {raw:.0} msgs/s, relay {drain:.0} msgs/s, ratio {:.2}\n  raw (self: lapin): {}\n  drain (self: the relay): {}",
            round + 1,
            drain / raw,
            raw_cpu.per_message(args.messages / args.pipeline * args.pipeline),
            drain_cpu.per_message(args.messages),
        );
        rounds.push((raw, drain));
    }
    let raw = outbox_tests::median(rounds.iter().map(|r| r.0).collect());
    let drain = outbox_tests::median(rounds.iter().map(|r| r.1).collect());
    let ratio = outbox_tests::median(rounds.iter().map(|r| r.1 / r.0).collect());

    // 1b. The relay's own publisher, fed from memory: the relay's broker-side
    // cost without Postgres, to tell the two apart.
    let publisher = Arc::new(outbox_relay::publish::amqp::AmqpPublisher::new(
        outbox_relay::publish::amqp::AmqpSettings {
            url: outbox_tests::amqp_url(),
            confirm_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            ca_pem: None,
        },
    ));
    {
        use outbox_relay::publish::Publisher;
        publisher.ready().await?;
    }
    let publisher_only = fan_out(args, {
        let (publisher, exchange, payload) =
            (Arc::clone(&publisher), exchange.clone(), payload.clone());
        let (per_task, keys) = (args.messages / args.pipeline, args.keys.max(1));
        move |t, sent, n| {
            use outbox_relay::publish::{Envelope, Publisher};
            let publisher = Arc::clone(&publisher);
            let envelopes: Vec<Envelope> = (0..n)
                .map(|i| Envelope {
                    seq: (t * per_task + sent + i) as i64,
                    message_id: uuid::Uuid::now_v7(),
                    destination: exchange.clone(),
                    ordering_key: Some(format!("key-{}", (sent + i) % keys)),
                    routing_key: ROUTING_KEY.into(),
                    headers: Vec::new(),
                    payload: payload.clone(),
                    content_type: Some(CONTENT_TYPE.into()),
                    event_type: None,
                    created_at: std::time::SystemTime::now(),
                    attempts: 0,
                })
                .collect();
            async move {
                let outcomes = publisher.publish(&envelopes).await?;
                if outcomes.iter().any(|o| o.is_err()) {
                    anyhow::bail!("relay publisher: a message was refused");
                }
                Ok(())
            }
        }
    })
    .await?;
    {
        use outbox_relay::publish::Publisher;
        publisher.close().await;
    }
    ch.queue_purge(queue.as_str().into(), QueuePurgeOptions::default())
        .await?;

    // 2. The same backlog drained by 2..=`--replicas` replicas sharing the
    // partitions.
    let mut replicated = Vec::new();
    for n in 2..=args.replicas {
        fill_outbox(&db, &exchange, args).await?;
        ch.queue_purge(queue.as_str().into(), QueuePurgeOptions::default())
            .await?;
        let started = Instant::now();
        let relays = (0..n)
            .map(|_| outbox_tests::InProcessRelay::amqp(&db, relay_settings(args)))
            .collect();
        replicated.push((n, drain_with(relays, args.messages, started).await));
    }

    println!("{:<44} {:>10} {:>8}", "", "msgs/s", "vs raw");
    println!(
        "{:<44} {:>10.0} {:>8}",
        "raw lapin publisher (same confirm window)", raw, "1.00"
    );
    println!(
        "{:<44} {:>10.0} {:>8.2}",
        "relay publisher alone, fed from memory",
        publisher_only,
        publisher_only / raw
    );
    println!(
        "{:<44} {:>10.0} {:>8.2}",
        "relay drain to rabbitmq (1 replica)", drain, ratio
    );
    for (n, r) in &replicated {
        println!(
            "{:<44} {:>10.0} {:>8.2}",
            format!("relay drain to rabbitmq ({n} replicas)"),
            r,
            r / raw
        );
    }
    println!(
        "{:<44} {:>10.0} {:>8}",
        "enqueue_batch (1,000 per statement)", enqueue, "-"
    );

    ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await?;
    ch.exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
        .await?;
    let _ = conn.close(200, "bench done".into()).await;
    db.cleanup().await;
    Ok(())
}

/// Raw lapin, persistent and mandatory, `args.pipeline` tasks each waiting for
/// the confirms of `args.batch` messages at a time: the relay's confirm window.
/// Each batch is handed to the connection at once, as the relay does.
async fn raw_lapin(
    args: &Args,
    pub_ch: &Arc<lapin::Channel>,
    exchange: &str,
    payload: &[u8],
) -> anyhow::Result<f64> {
    fan_out(args, {
        let (ch, exchange, payload) = (Arc::clone(pub_ch), exchange.to_owned(), payload.to_vec());
        move |_, _, n| {
            let (ch, exchange, payload) = (Arc::clone(&ch), exchange.clone(), payload.clone());
            async move {
                let mut handed = Vec::with_capacity(n);
                for _ in 0..n {
                    // What the relay sends for a row without headers.
                    let timestamp = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_secs());
                    let props = BasicProperties::default()
                        .with_message_id(uuid::Uuid::now_v7().to_string().into())
                        .with_delivery_mode(2)
                        .with_timestamp(timestamp)
                        .with_headers(FieldTable::default())
                        .with_content_type(CONTENT_TYPE.into());
                    // Queued when first polled, in order; the writes are
                    // awaited together, as the relay does.
                    let mut publish = Box::pin(ch.basic_publish(
                        exchange.as_str().into(),
                        ROUTING_KEY.into(),
                        BasicPublishOptions {
                            mandatory: true,
                            immediate: false,
                        },
                        &payload,
                        props,
                    ));
                    handed.push(match futures::poll!(publish.as_mut()) {
                        std::task::Poll::Ready(r) => Either::Left(futures::future::ready(r)),
                        std::task::Poll::Pending => Either::Right(publish),
                    });
                }
                let confirms = futures::future::try_join_all(handed).await?;
                for c in join_all(confirms).await {
                    if !matches!(c?, Confirmation::Ack(None)) {
                        anyhow::bail!("raw publish not acked");
                    }
                }
                Ok(())
            }
        }
    })
    .await
}

/// What the broker stored for one message of `queue`, ids and times aside:
/// the size and properties that decide what a message costs the broker.
async fn shape(ch: &lapin::Channel, queue: &str) -> anyhow::Result<String> {
    let Some(got) = ch
        .basic_get(
            queue.into(),
            lapin::options::BasicGetOptions { no_ack: true },
        )
        .await?
    else {
        anyhow::bail!("queue {queue} is empty after a run");
    };
    let p = &got.delivery.properties;
    Ok(format!(
        "routing key {:?}, {} body bytes, content type {:?}, delivery mode {:?}, \
         message id of {} chars, timestamp {}, headers {:?}",
        got.delivery.routing_key.as_str(),
        got.delivery.data.len(),
        p.content_type().as_ref().map(|c| c.as_str()),
        p.delivery_mode(),
        p.message_id().as_ref().map_or(0, |m| m.as_str().len()),
        if p.timestamp().is_some() {
            "set"
        } else {
            "unset"
        },
        p.headers().as_ref().map(|h| h.inner().len()),
    ))
}

/// Drains one backlog with a relay process and returns (seconds, peak RSS KiB).
async fn drain_process(
    bin: &std::path::Path,
    db: &TestDb,
    expected: usize,
    consumer_queue: &str,
    ch: &lapin::Channel,
) -> anyhow::Result<(f64, u64)> {
    let drained =
        drain_process_with(bin, db, expected, consumer_queue, ch, &[], || async {}).await?;
    Ok((drained.secs, drained.peak_rss_kib))
}

/// What one relay process's drain measured.
struct Drained {
    secs: f64,
    /// Messages per second from the first scrape that counted a published
    /// message to the end: the drain without the process's start-up (connect,
    /// schema check, partitions), which weighs on a short drain alone. Only
    /// measured through the relay's counter; otherwise over `secs`.
    rate_after_start: f64,
    peak_rss_kib: u64,
    cpu: Duration,
    /// CPU of Postgres, RabbitMQ and the relay over the drain.
    split: outbox_tests::cpu::CpuSplit,
    /// What Postgres wrote over the drain, per message.
    writes: String,
}

/// Postgres's cluster-wide write counters (`pg_stat_wal`,
/// `pg_stat_bgwriter`): a drain whose table no longer fits in
/// `shared_buffers` pays for full-page images after each checkpoint and for
/// evicting the pages it dirtied, which one that fits does not.
#[derive(Debug, Clone, Copy, Default)]
struct PgWrites {
    wal_bytes: f64,
    full_page_images: f64,
    checkpoints: f64,
    /// Buffers written out by backends (evictions) and by the background
    /// writer, besides checkpoints.
    evicted: f64,
}

impl PgWrites {
    async fn read(client: &tokio_postgres::Client) -> anyhow::Result<Self> {
        let row = client
            .query_one(
                "SELECT w.wal_bytes::float8, w.wal_fpi::float8, \
                        (b.checkpoints_timed + b.checkpoints_req)::float8, \
                        (b.buffers_backend + b.buffers_clean)::float8 \
                 FROM pg_stat_wal w, pg_stat_bgwriter b",
                &[],
            )
            .await?;
        Ok(PgWrites {
            wal_bytes: row.get(0),
            full_page_images: row.get(1),
            checkpoints: row.get(2),
            evicted: row.get(3),
        })
    }

    /// Reads the counters once this session's own statistics are flushed
    /// and every other session of the database not in `keep` has ended. A
    /// session reports its WAL at most once a second while busy, up to 10 s
    /// late once idle, and last as it exits: read at once, a drain of under
    /// a second showed none of its WAL, and the fill's could land in the
    /// drain's count.
    async fn settled(client: &tokio_postgres::Client, keep: &[i32]) -> anyhow::Result<Self> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while other_sessions(client)
            .await?
            .iter()
            .any(|p| !keep.contains(p))
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Postgres 15 and later; on 14 the session's own last second may
        // be missing.
        let _ = client
            .batch_execute("SELECT pg_stat_force_next_flush()")
            .await;
        Self::read(client).await
    }

    /// Per message of `messages`, since `before`.
    fn per_message(&self, before: &PgWrites, messages: usize) -> String {
        let n = messages.max(1) as f64;
        format!(
            "Postgres wrote per message: {:.0} bytes of WAL, {:.3} full-page images, {:.3} buffers evicted; {:.0} checkpoints",
            (self.wal_bytes - before.wal_bytes) / n,
            (self.full_page_images - before.full_page_images) / n,
            (self.evicted - before.evicted) / n,
            self.checkpoints - before.checkpoints,
        )
    }
}

/// The other client sessions on `client`'s database, by backend pid.
async fn other_sessions(client: &tokio_postgres::Client) -> anyhow::Result<Vec<i32>> {
    let rows = client
        .query(
            "SELECT pid FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid() \
               AND backend_type = 'client backend'",
            &[],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Runs the relay process with `env` added until the outbox is empty (or,
/// with `expected` 0, for 3 s idle). `halfway` runs once when half the rows
/// are gone, while the relay keeps draining.
async fn drain_process_with<F, Fut>(
    bin: &std::path::Path,
    db: &TestDb,
    expected: usize,
    consumer_queue: &str,
    ch: &lapin::Channel,
    env: &[(&str, &str)],
    halfway: F,
) -> anyhow::Result<Drained>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut halfway = Some(halfway);
    // Progress is read from the relay's own counter of published messages.
    // Counting the outbox's rows instead scanned the whole table every
    // 20 ms: at 1,000,000 rows of 1 KiB that is a gigabyte read over and
    // over, on the same two cores and through the same buffer cache as the
    // drain it measures. The bench's own OUTBOX_HTTP_ADDR ("off", say)
    // passes through, and then the rows are counted.
    let (http_addr, metrics_port) = match std::env::var("OUTBOX_HTTP_ADDR") {
        Ok(addr) => (addr, None),
        Err(_) => {
            let port = std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port();
            (format!("127.0.0.1:{port}"), Some(port))
        }
    };
    let keep = other_sessions(&db.client).await?;
    let writes_before = PgWrites::settled(&db.client, &keep).await?;
    let mut child = tokio::process::Command::new(bin)
        .arg("run")
        .envs(env.iter().copied())
        .env("OUTBOX_DATABASE_URL", outbox_tests::pg_url())
        .env("OUTBOX_AMQP_URL", outbox_tests::amqp_url())
        .env("OUTBOX_SCHEMA", db.schema.as_str())
        .env("OUTBOX_HTTP_ADDR", http_addr)
        .env("OUTBOX_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let pid = child.id().unwrap_or(0);
    let watch = CpuWatch::start(&BACKLOG_PROGRAMS);
    let started = Instant::now();
    let count_rows = || async {
        db.client
            .query_one(&format!("SELECT count(*) FROM {}", db.table()), &[])
            .await
            .map(|r| r.get::<_, i64>(0))
    };
    // OUTBOX_BENCH_TRACE=1 prints the rate of each tenth of the drain to
    // stderr: a drain that slows as it goes and one that is slow throughout
    // have different causes.
    let trace = std::env::var_os("OUTBOX_BENCH_TRACE").is_some();
    let (mut tenth, mut tenth_at, mut tenth_done) = (1usize, Instant::now(), 0i64);
    let mut tenth_timings = [0.0; 6];
    let mut first_published: Option<(Instant, i64)> = None;
    loop {
        let mut metrics = String::new();
        let left = match metrics_port {
            // Settled rows are counted after their transaction commits, so
            // once all are counted the outbox is empty (checked below).
            Some(port) => {
                metrics = outbox_tests::http::scrape(port).await;
                expected as i64 - outbox_tests::http::published(&metrics) as i64
            }
            None => count_rows().await?,
        };
        let done = expected as i64 - left;
        if done > 0 && metrics_port.is_some() && first_published.is_none() {
            first_published = Some((Instant::now(), done));
        }
        if trace && expected > 0 && done as usize >= expected * tenth / 10 {
            // Claims and publishes in this tenth: count and mean time each.
            let timings = batch_timings(&metrics);
            let d: [f64; 4] = std::array::from_fn(|i| timings[i] - tenth_timings[i]);
            eprintln!(
                "  {expected}: tenth {tenth} at {:.1} s, {:.0} msgs/s; {:.0} claims of {:.2} ms; {:.0} batches at the broker for {:.2} ms",
                started.elapsed().as_secs_f64(),
                (done - tenth_done) as f64 / tenth_at.elapsed().as_secs_f64(),
                d[0],
                d[1] / d[0].max(1.0) * 1000.0,
                d[2],
                d[3] / d[2].max(1.0) * 1000.0,
            );
            (tenth, tenth_at, tenth_done, tenth_timings) =
                (tenth + 1, Instant::now(), done, timings);
        }
        if left <= 0 || expected == 0 {
            break;
        }
        if started.elapsed() > Duration::from_secs(600) {
            child.kill().await?;
            anyhow::bail!("{left} rows still waiting after 10 minutes");
        }
        if left as usize <= expected / 2 {
            if let Some(f) = halfway.take() {
                f().await;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if expected == 0 {
        // Idle: let it connect, take its partitions and poll a few times.
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    let ended = Instant::now();
    let split = watch.stop().await;
    let secs = (ended - started).as_secs_f64();
    let left = count_rows().await?;
    anyhow::ensure!(
        left == 0 || expected == 0,
        "the relay counted {expected} published but {left} rows are still in the outbox"
    );
    let peak_rss_kib = outbox_tests::process::peak_rss_kib(pid).unwrap_or(0);
    let cpu = outbox_tests::process::cpu_time_of(pid).unwrap_or_default();
    child.kill().await?;
    let writes = PgWrites::settled(&db.client, &keep).await?;
    ch.queue_purge(consumer_queue.into(), QueuePurgeOptions::default())
        .await?;
    let rate_after_start = match first_published {
        Some((at, done)) if expected as i64 > done => {
            (expected as i64 - done) as f64 / (ended - at).as_secs_f64()
        }
        _ => expected as f64 / secs,
    };
    Ok(Drained {
        secs,
        rate_after_start,
        peak_rss_kib,
        cpu,
        split,
        writes: writes.per_message(&writes_before, expected),
    })
}

/// Drains backlogs of each size to one queue on the default exchange, which a
/// consumer empties (unless OUTBOX_BENCH_NO_CONSUMER is set), with
/// the release relay process: with no other session, with a REPEATABLE READ
/// snapshot held open from before the backlog was written to the end of the
/// drain, (up to 100,000) pinned with the claim floor off, the relay as
/// it was before the floor, and beside a transaction that wrote one outbox
/// row before the backlog and stays open (see [`Pin::Writer`]). Prints each drain rate against the unpinned
/// drain of 10,000 (the first size), the relay's peak RSS and CPU, and the
/// claim's cost halfway through each pinned drain of 1,000,000 or more.
async fn backlog(args: &Args) -> anyhow::Result<()> {
    let bin = outbox_tests::process::release_relay_binary()?;
    let queue = outbox_tests::unique("backlogq");
    let conn =
        Connection::connect(&outbox_tests::amqp_url(), ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    // Bounded, so a million messages do not sit in the broker's memory; the
    // broker still routes, stores and confirms every one.
    let mut queue_args = FieldTable::default();
    queue_args.insert(
        "x-max-length".into(),
        lapin::types::AMQPValue::LongLongInt(50_000),
    );
    ch.queue_declare(
        queue.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        queue_args,
    )
    .await?;
    // A consumer (no acks) empties the queue as the relay fills it, as a
    // deployment's consumers would. Without one (OUTBOX_BENCH_NO_CONSUMER=1)
    // the queue sits at its bound and the broker drops a message for every
    // one it takes: at 1,000,000 that cost the broker 120-146 ms per batch
    // against 85-95 ms for a drain of 10,000, which never reaches the bound.
    let received = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let consumer = if std::env::var_os("OUTBOX_BENCH_NO_CONSUMER").is_none() {
        let cch = conn.create_channel().await?;
        let mut consumer = cch
            .basic_consume(
                queue.as_str().into(),
                "bench-consumer".into(),
                lapin::options::BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
        let received = Arc::clone(&received);
        Some(tokio::spawn(async move {
            use futures::StreamExt;
            while let Some(Ok(_)) = consumer.next().await {
                received.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            drop(cch);
        }))
    } else {
        None
    };
    let autovacuum: String = {
        let db = TestDb::new().await;
        let v = db.client.query_one("SHOW autovacuum", &[]).await?.get(0);
        db.cleanup().await;
        v
    };
    println!(
        "autovacuum = {autovacuum}; one durable queue on the default exchange, {}; 1 KiB over {} keys; {}",
        if consumer.is_some() { "emptied by a consumer" } else { "no consumer, bounded at 50,000 (drop-head)" },
        args.keys,
        if args.checkpoint { "a CHECKPOINT between filling and draining" } else { "drained right after filling" }
    );
    println!(
        "{:<10} {:<26} {:>10} {:>9} {:>9} {:>10} {:>12}",
        "backlog",
        "snapshot",
        "msgs/s",
        // The baseline is the first size asked for.
        format!("vs {}", args.sizes[0]),
        "RSS MiB",
        "CPU s/10k",
        "claim"
    );
    let run = BacklogRun {
        args,
        bin: &bin,
        queue: &queue,
        ch: &ch,
        received: consumer.is_some().then_some(&*received),
    };
    // (size, snapshot, rate, rate against its round's first drain), every round.
    let mut results: Vec<(usize, &str, f64, f64)> = Vec::new();
    for round in 1..=args.rounds {
        if args.rounds > 1 {
            println!("round {round} of {}", args.rounds);
        }
        let mut baseline = None;
        for &size in &args.sizes {
            let variants: &[(&str, Pin, bool)] = if size <= 100_000 {
                &[
                    ("none", Pin::None, true),
                    ("pinned", Pin::Snapshot, true),
                    ("pinned, floor off", Pin::Snapshot, false),
                    ("writer open", Pin::Writer, true),
                ]
            } else {
                &[
                    ("none", Pin::None, true),
                    ("pinned", Pin::Snapshot, true),
                    ("writer open", Pin::Writer, true),
                ]
            };
            for &(label, pin, floor_on) in variants {
                let rate = run.drain(size, label, pin, floor_on, &mut baseline).await?;
                results.push((size, label, rate, rate / baseline.unwrap_or(rate)));
            }
        }
    }
    if args.rounds > 1 {
        print_medians(&results, args.rounds);
    }
    ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await?;
    let _ = conn.close(200, "bench done".into()).await;
    Ok(())
}

/// What a backlog drain runs beside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pin {
    /// Nothing.
    None,
    /// A REPEATABLE READ snapshot, open from before the backlog was written
    /// to the end of the drain (a report, pg_dump).
    Snapshot,
    /// A transaction that wrote one outbox row before the backlog, open to
    /// the end of the drain (a long import, a forgotten `BEGIN` after an
    /// insert): it pins the horizon as the snapshot does, and also holds a
    /// writer's lock on the outbox, with a row below the whole backlog.
    Writer,
}

/// What every drain of `bench --broker backlog` shares.
struct BacklogRun<'a> {
    args: &'a Args,
    bin: &'a std::path::Path,
    queue: &'a str,
    ch: &'a lapin::Channel,
    /// Messages the queue's consumer received, when one runs.
    received: Option<&'a std::sync::atomic::AtomicU64>,
}

impl BacklogRun<'_> {
    /// Fills a new outbox with `size` rows and drains it with a relay
    /// process, with a snapshot held open (`pinned`) or not and the claim
    /// floor on or off; prints the drain's line against `baseline` (set to
    /// this rate when it is the round's first) and returns its rate.
    async fn drain(
        &self,
        size: usize,
        label: &str,
        pin_with: Pin,
        floor_on: bool,
        baseline: &mut Option<f64>,
    ) -> anyhow::Result<f64> {
        let db = TestDb::new().await;
        outbox_client::set_notify(&db.client, db.schema.as_str(), false).await?;
        let pin = outbox_tests::db::connect(&db.config).await;
        let pinned = pin_with != Pin::None;
        match pin_with {
            Pin::None => {}
            Pin::Snapshot => pin.batch_execute(outbox_tests::db::PIN_SNAPSHOT).await?,
            Pin::Writer => {
                pin.batch_execute("BEGIN").await?;
                let row = outbox_client::Message::builder("amq.default")
                    .routing_key(self.queue)
                    .key("open-writer")
                    .payload(vec![0u8; 1024])
                    .build()?;
                db.outbox().enqueue(&pin, &row).await?;
            }
        }
        let fill = Args {
            messages: size,
            sizes: Vec::new(),
            broker: String::new(),
            ..*self.args
        };
        fill_outbox_to(&db, "amq.default", self.queue, &fill).await?;
        if self.args.checkpoint {
            // A backlog that built up over an outage has seen a checkpoint
            // since its rows were written (every checkpoint_timeout), so
            // deleting each heap page logs it whole. A small backlog filled
            // just before its drain would not pay that; this makes every
            // size pay it.
            db.client.batch_execute("CHECKPOINT").await?;
        }
        let mut env = Vec::new();
        if !floor_on {
            env.push(("OUTBOX_CLAIM_FLOOR_RESCAN", "0s"));
        }
        let claim_halfway = std::sync::Mutex::new(String::new());
        let drained =
            drain_process_with(self.bin, &db, size, self.queue, self.ch, &env, || async {
                if pinned && size >= 1_000_000 {
                    *claim_halfway.lock().expect("not poisoned") =
                        claim_below_floor(&db, size).await;
                }
            })
            .await?;
        let rate = drained.rate_after_start;
        let base = *baseline.get_or_insert(rate);
        let claim = claim_halfway.into_inner().expect("not poisoned");
        println!(
            "{:<10} {:<26} {:>10.0} {:>9.2} {:>9.1} {:>10.2} {:>12}",
            size,
            label,
            rate,
            rate / base,
            drained.peak_rss_kib as f64 / 1024.0,
            drained.cpu.as_secs_f64() / size as f64 * 10_000.0,
            if claim.is_empty() { "-" } else { "below" }
        );
        if !claim.is_empty() {
            println!("  {claim}");
        }
        println!("  {}", drained.split.per_message(size));
        println!("  {}", drained.writes);
        if let Some(received) = self.received {
            // What it had not received when the drain ended was purged (or,
            // had it fallen 50,000 behind, dropped at the bound).
            let got = received.swap(0, std::sync::atomic::Ordering::Relaxed);
            if got < size as u64 {
                println!("  the consumer received {got} of {size} before the queue was purged");
            }
        }
        if pinned {
            pin.batch_execute("ROLLBACK").await?;
        }
        db.cleanup().await;
        Ok(rate)
    }
}

/// The claim's cost halfway through a pinned drain of `size`: from seq 0
/// and from the claim floor, in time and buffers touched.
async fn claim_below_floor(db: &TestDb, size: usize) -> String {
    let (config, schema) = (&db.config, &db.schema);
    async {
        let client = outbox_tests::db::connect(config).await;
        let floor = outbox_tests::claim::floor(&client, schema).await?;
        let (walk, _) = outbox_tests::claim::run_claim(config, schema, 0).await?;
        let (from, _) = outbox_tests::claim::run_claim(config, schema, floor).await?;
        anyhow::Ok(format!(
            "halfway through the pinned drain of {size}: the claim from seq 0 ran {:.1} ms touching {} buffers; from the floor ({floor}) {:.1} ms, {} buffers",
            walk.ms, walk.buffers, from.ms, from.buffers
        ))
    }
    .await
    .unwrap_or_else(|e| format!("claim not measured: {e}"))
}

/// The medians over the rounds of each size and snapshot: its rate and its
/// ratio to its round's first drain, with every round's ratio.
fn print_medians(results: &[(usize, &str, f64, f64)], rounds: usize) {
    // Each round's ratios are to its own first drain, so a machine that
    // slows between rounds moves the rates, not the ratios.
    println!("medians over {rounds} rounds");
    println!(
        "{:<10} {:<26} {:>10} {:>9}  ratios by round",
        "backlog", "snapshot", "msgs/s", "vs first"
    );
    let mut seen: Vec<(usize, &str)> = Vec::new();
    for &(size, label, _, _) in results {
        if seen.contains(&(size, label)) {
            continue;
        }
        seen.push((size, label));
        let of = |pick: fn(&(usize, &str, f64, f64)) -> f64| -> Vec<f64> {
            results
                .iter()
                .filter(|r| r.0 == size && r.1 == label)
                .map(pick)
                .collect()
        };
        let ratios = of(|r| r.3);
        println!(
            "{:<10} {:<26} {:>10.0} {:>9.2}  {}",
            size,
            label,
            outbox_tests::median(of(|r| r.2)),
            outbox_tests::median(ratios.clone()),
            ratios
                .iter()
                .map(|r| format!("{r:.2}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
}

/// Peak RSS of the relay process per payload size, against the same process
/// idle, all in one run.
async fn memory() -> anyhow::Result<()> {
    use rand::{Rng, SeedableRng};
    let bin = outbox_tests::process::release_relay_binary()?;
    let exchange = outbox_tests::unique("benchmem");
    let queue = outbox_tests::unique("benchmemq");
    let conn =
        Connection::connect(&outbox_tests::amqp_url(), ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    outbox_tests::amqp::declare_topology(&ch, &exchange, &queue).await?;
    // (label, payload sizes to draw from, messages)
    let cases: [(&str, &[usize], usize); 4] = [
        ("1 KiB", &[1024], 50_000),
        ("100 KiB", &[100 * 1024], 2_000),
        ("1 MiB", &[1024 * 1024], 300),
        ("mix of the three", &[1024, 100 * 1024, 1024 * 1024], 1_500),
    ];
    let idle_db = TestDb::new().await;
    let (_, idle) = drain_process(&bin, &idle_db, 0, &queue, &ch).await?;
    idle_db.cleanup().await;
    println!(
        "{:<20} {:>9} {:>12} {:>14} {:>9}",
        "payload", "messages", "drain s", "peak RSS MiB", "vs idle"
    );
    println!(
        "{:<20} {:>9} {:>12} {:>14.1} {:>9}",
        "(idle relay)",
        0,
        "-",
        idle as f64 / 1024.0,
        "1.00"
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for (label, sizes, messages) in cases {
        let db = TestDb::new().await;
        outbox_client::set_notify(&db.client, db.schema.as_str(), false).await?;
        let outbox = db.outbox().max_payload_bytes(1024 * 1024);
        let mut written = 0;
        while written < messages {
            let mut chunk = Vec::new();
            let mut bytes = 0;
            while written < messages && bytes < 16 * 1024 * 1024 {
                let size = sizes[rng.random_range(0..sizes.len())];
                chunk.push(
                    Message::builder(exchange.as_str())
                        .key(format!("key-{}", written % 1000))
                        .payload(vec![b'x'; size])
                        .build()?,
                );
                bytes += size;
                written += 1;
            }
            outbox.enqueue_batch(&db.client, &chunk).await?;
        }
        let (secs, peak) = drain_process(&bin, &db, messages, &queue, &ch).await?;
        println!(
            "{:<20} {:>9} {:>12.1} {:>14.1} {:>9.2}",
            label,
            messages,
            secs,
            peak as f64 / 1024.0,
            peak as f64 / idle.max(1) as f64
        );
        db.cleanup().await;
    }
    ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await?;
    ch.exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
        .await?;
    let _ = conn.close(200, "bench done".into()).await;
    Ok(())
}
