//! What finding rows costs the writers and the relay, in one run:
//!
//! `cargo run --release -p outbox-tests --bin bench-wake -- writers [--seconds S] [--rounds R] [--clients N]...`
//!   commits one 1 KiB row per transaction from 1, 4, 16 and 64 connections
//!   (or each `--clients` given)
//!   into a plain table with the outbox's columns and indexes and no trigger
//!   (the baseline), into the outbox as `migrate` leaves it, into the outbox
//!   with NOTIFY on, and through `outbox.enqueue(...)`; by pgbench (plain SQL
//!   from another program) and by `outbox-client` (`Outbox::enqueue` against
//!   the same INSERT into the plain table). Runs alternate, each round
//!   starting one target later than the last; each figure is
//!   the median of the rounds, as a ratio to the plain table.
//!
//! `... -- latency [--rate N]... [--seconds S] [--keys K] [--writers W] [--per-tx N] [--notify on|off] [--broker amqp|kafka] [--pin] [--fetch-wait-ms N]`
//! (`--pin` holds a REPEATABLE READ snapshot open for the whole run, as a
//! long report or pg_dump would; `--fetch-wait-ms` is the Kafka consumer's
//! `fetch.wait.max.ms`, 1 unless given)
//!   runs the release relay (`cargo build --release -p outbox-relay`) with
//!   default settings, writes at each fixed rate (default 1,000 and 5,000
//!   msg/s, one 1 KiB message per transaction from 16 connections, or
//!   `--per-tx` per transaction from `--writers`), and reports
//!   commit-to-consumer p50, p99 and max, the relay's CPU seconds per 10,000
//!   messages, its CPU while idle, its peak RSS, and each program's CPU per
//!   message (with what the relay's own sessions cost Postgres) and the
//!   machine's idle share.
//!   Under each rate, the means of the relay's own stage histograms (claim,
//!   durable wait, publish, a row's insert to its confirm) beside the mean
//!   commit to consumer say which side of the broker's confirm the time goes.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use outbox_client::Message;
use outbox_tests::amqp::Fixture;
use outbox_tests::db::TestDb;
use outbox_tests::process::{cpu_time_of, peak_rss_kib, release_relay_binary};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::Message as _;

const CLIENTS: [usize; 4] = [1, 4, 16, 64];
const PAYLOAD: usize = 1024;

/// The relay's histograms whose means `latency` prints, with their labels:
/// every claim (most find nothing while the relay keeps up), a claimed
/// batch's wait for its rows to be durable, its publish, and a message's
/// commit to the broker's confirm.
const STAGES: [(&str, &str); 4] = [
    ("outbox_claim_seconds", "claim"),
    ("outbox_durable_wait_seconds", "durable wait"),
    ("outbox_publish_seconds", "publish"),
    ("outbox_commit_to_confirm_seconds", "insert to confirm"),
];
/// Where `outbox_publish_seconds` is in `STAGES`: one sample per batch.
const PUBLISH_STAGE: usize = 2;

fn arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    let argv: Vec<String> = std::env::args().collect();
    argv.iter()
        .position(|a| a == name)
        .and_then(|i| argv.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn args_all(name: &str) -> Vec<String> {
    let argv: Vec<String> = std::env::args().collect();
    argv.windows(2)
        .filter(|w| w[0] == name)
        .map(|w| w[1].clone())
        .collect()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match std::env::args().nth(1).as_deref() {
        Some("writers") => {
            let mut clients: Vec<usize> = args_all("--clients")
                .iter()
                .filter_map(|c| c.parse().ok())
                .collect();
            if clients.is_empty() {
                clients = CLIENTS.to_vec();
            }
            writers(arg("--seconds", 8), arg("--rounds", 2), &clients).await
        }
        Some("latency") => {
            let mut rates: Vec<u64> = args_all("--rate")
                .iter()
                .filter_map(|r| r.parse().ok())
                .collect();
            if rates.is_empty() {
                rates = vec![1_000, 5_000];
            }
            let broker = arg("--broker", "amqp".to_owned());
            let notify = arg("--notify", "off".to_owned()) == "on";
            let pin = std::env::args().any(|a| a == "--pin");
            latency(
                &rates,
                &Latency {
                    seconds: arg("--seconds", 20),
                    keys: arg("--keys", 10_000),
                    writers: arg("--writers", 16),
                    per_tx: arg("--per-tx", 1usize).max(1),
                    notify,
                    broker,
                    pin,
                    fetch_wait_ms: arg("--fetch-wait-ms", 1),
                },
            )
            .await
        }
        _ => {
            eprintln!("usage: bench-wake writers [--seconds S] [--rounds R] [--clients N]... | latency [--rate N]... [--seconds S] [--keys K] [--writers W] [--per-tx N] [--notify on|off] [--broker amqp|kafka] [--pin] [--fetch-wait-ms N]");
            std::process::exit(2);
        }
    }
}

/// What a writer commits into, each transaction one row.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Target {
    Plain,
    Outbox,
    OutboxNotify,
    Function,
}

impl Target {
    fn label(self) -> &'static str {
        match self {
            Target::Plain => "plain table (baseline)",
            Target::Outbox => "outbox as migrated",
            Target::OutboxNotify => "outbox, NOTIFY on",
            Target::Function => "outbox.enqueue()",
        }
    }
}

async fn writers(seconds: u64, rounds: usize, counts: &[usize]) -> anyhow::Result<()> {
    let db = TestDb::new().await;
    let s = db.schema.quoted();
    db.client
        .batch_execute(&format!(
            "CREATE TABLE {s}.plain (LIKE {s}.messages INCLUDING ALL)"
        ))
        .await?;
    let dir = std::env::temp_dir().join(outbox_tests::unique("pgbench"));
    std::fs::create_dir_all(&dir)?;
    let payload = format!("decode(repeat('78', {PAYLOAD}), 'hex')");
    let scripts = [
        (
            Target::Plain,
            format!("INSERT INTO {s}.plain (destination, ordering_key, payload) VALUES ('bench', 'k' || :client_id, {payload});\n"),
        ),
        (
            Target::Outbox,
            format!("INSERT INTO {s}.messages (destination, ordering_key, payload) VALUES ('bench', 'k' || :client_id, {payload});\n"),
        ),
        (
            Target::OutboxNotify,
            format!("INSERT INTO {s}.messages (destination, ordering_key, payload) VALUES ('bench', 'k' || :client_id, {payload});\n"),
        ),
        (
            Target::Function,
            format!("SELECT {s}.enqueue('bench', {payload}, key => 'k' || :client_id);\n"),
        ),
    ];
    for (t, sql) in &scripts {
        std::fs::write(dir.join(format!("{t:?}.sql")), sql)?;
    }
    let pg = db.config.clone();
    let host = "127.0.0.1";
    let port = pg.get_ports().first().copied().unwrap_or(5432);
    let user = pg.get_user().unwrap_or("postgres").to_owned();
    let dbname = pg.get_dbname().unwrap_or("postgres").to_owned();
    let sv = db
        .client
        .query_one("SELECT current_setting('server_version'), current_setting('autovacuum'), current_setting('synchronous_commit')", &[])
        .await?;
    println!(
        "postgres {} autovacuum={} synchronous_commit={}; {seconds}s per run, {rounds} rounds, 1 KiB rows, one row per transaction",
        sv.get::<_, String>(0),
        sv.get::<_, String>(1),
        sv.get::<_, String>(2)
    );

    let reset = |notify: bool| {
        let s = s.clone();
        let client = &db.client;
        async move {
            client
                .batch_execute(&format!(
                    "TRUNCATE {s}.plain, {s}.messages; CHECKPOINT; ALTER TABLE {s}.messages {} TRIGGER messages_notify",
                    if notify { "ENABLE" } else { "DISABLE" }
                ))
                .await
        }
    };

    print_header("plain SQL (pgbench)");
    for &clients in counts {
        let mut tps: std::collections::HashMap<&str, Vec<f64>> = Default::default();
        for round in 0..rounds {
            // Each round starts one target later, so no target always runs
            // after the same one (the NOTIFY run, say) or at the same point
            // of a round.
            for i in 0..scripts.len() {
                let (target, _) = &scripts[(round + i) % scripts.len()];
                reset(*target == Target::OutboxNotify).await?;
                let out = tokio::process::Command::new("pgbench")
                    .args(["-n", "-h", host, "-p", &port.to_string(), "-U", &user])
                    .args([
                        "-c",
                        &clients.to_string(),
                        "-j",
                        &clients.min(2).to_string(),
                    ])
                    .args(["-T", &seconds.to_string(), "-f"])
                    .arg(dir.join(format!("{target:?}.sql")))
                    .arg(&dbname)
                    .output()
                    .await?;
                let text = String::from_utf8_lossy(&out.stdout);
                let value = text
                    .lines()
                    .find_map(|l| l.strip_prefix("tps = "))
                    .and_then(|l| l.split_whitespace().next())
                    .and_then(|v| v.parse::<f64>().ok())
                    .ok_or_else(|| {
                        anyhow::anyhow!(
                            "pgbench gave no tps: {text}{}",
                            String::from_utf8_lossy(&out.stderr)
                        )
                    })?;
                tps.entry(target.label()).or_default().push(value);
            }
        }
        let targets: Vec<Target> = scripts.iter().map(|(t, _)| *t).collect();
        print_ratios(&targets, clients, &tps);
    }

    print_header("outbox-client (tokio-postgres)");
    for &clients in counts {
        let mut tps: std::collections::HashMap<&str, Vec<f64>> = Default::default();
        for round in 0..rounds {
            let targets = [Target::Plain, Target::Outbox, Target::OutboxNotify];
            for i in 0..targets.len() {
                let target = targets[(round + i) % targets.len()];
                reset(target == Target::OutboxNotify).await?;
                let v = client_run(&db, target, clients, Duration::from_secs(seconds)).await?;
                tps.entry(target.label()).or_default().push(v);
            }
        }
        print_ratios(
            &[Target::Plain, Target::Outbox, Target::OutboxNotify],
            clients,
            &tps,
        );
    }
    std::fs::remove_dir_all(&dir).ok();
    db.cleanup().await;
    Ok(())
}

fn print_header(title: &str) {
    println!("\n-- {title} --");
    println!(
        "{:<26} {:>8} {:>10} {:>8}",
        "target", "clients", "tps", "ratio"
    );
}

/// One line per target: median tps, its ratio to the plain table's median,
/// and each round's ratio.
fn print_ratios(
    targets: &[Target],
    clients: usize,
    tps: &std::collections::HashMap<&str, Vec<f64>>,
) {
    let base = outbox_tests::median(tps[Target::Plain.label()].clone());
    for target in targets {
        let v = &tps[target.label()];
        println!(
            "{:<26} {:>8} {:>10.0} {:>8.2}   rounds: {}",
            target.label(),
            clients,
            outbox_tests::median(v.clone()),
            outbox_tests::median(v.clone()) / base,
            v.iter()
                .map(|x| format!("{:.2}", x / base))
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
}

/// `clients` connections committing one row per transaction for `run`:
/// `Outbox::enqueue`, or the same columns into the plain table.
async fn client_run(
    db: &TestDb,
    target: Target,
    clients: usize,
    run: Duration,
) -> anyhow::Result<f64> {
    let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let deadline = Instant::now() + run;
    let mut tasks = Vec::new();
    for c in 0..clients {
        let config = db.config.clone();
        let outbox = db.outbox();
        let plain = format!(
            "INSERT INTO {}.plain (message_id, destination, ordering_key, routing_key, headers, payload, content_type) \
             SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::jsonb[], $6::bytea[], $7::text[])",
            db.schema.quoted()
        );
        let done = Arc::clone(&done);
        tasks.push(tokio::spawn(async move {
            let mut client = outbox_tests::db::connect(&config).await;
            let message = Message::builder("bench")
                .key(format!("k{c}"))
                .payload(vec![b'x'; PAYLOAD])
                .build()?;
            while Instant::now() < deadline {
                let tx = client.transaction().await?;
                match target {
                    Target::Plain => {
                        let id = uuid::Uuid::now_v7();
                        tx.execute(
                            plain.as_str(),
                            &[
                                &vec![id],
                                &vec!["bench"],
                                &vec![Some(format!("k{c}"))],
                                &vec![""],
                                &vec![serde_json::json!({})],
                                &vec![vec![b'x'; PAYLOAD]],
                                &vec![Some("application/octet-stream")],
                            ],
                        )
                        .await?;
                    }
                    _ => {
                        outbox.enqueue(&tx, &message).await?;
                    }
                }
                tx.commit().await?;
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(done.load(std::sync::atomic::Ordering::Relaxed) as f64 / run.as_secs_f64())
}

/// The sequence number a benchmark payload starts with.
fn seq_of(payload: &[u8]) -> usize {
    payload
        .get(..12)
        .and_then(|p| std::str::from_utf8(p).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(usize::MAX)
}

/// Commit-to-receipt latencies (ms), sorted, of the messages from sequence
/// number `from` on that have arrived, on RabbitMQ (`rabbit`) or Kafka.
fn latencies(
    rabbit: &Option<Fixture>,
    kafka: &Mutex<Vec<(usize, Instant)>>,
    commits: &Mutex<Vec<Option<Instant>>>,
    from: usize,
) -> Vec<f64> {
    let received: Vec<(usize, Instant)> = match rabbit {
        Some(f) => f
            .deliveries()
            .iter()
            .map(|d| (seq_of(&d.payload), d.received))
            .collect(),
        None => kafka.lock().expect("lock").clone(),
    };
    let commits = commits.lock().expect("lock");
    let mut ms: Vec<f64> = received
        .iter()
        .filter(|(seq, _)| *seq >= from && *seq != usize::MAX)
        .map(|(seq, at)| {
            // A receipt before the writer saw its commit return counts as 0.
            commits
                .get(*seq)
                .copied()
                .flatten()
                .map_or(0.0, |c| at.saturating_duration_since(c).as_secs_f64() * 1e3)
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    ms
}

/// The relay's Postgres backends (every session names itself
/// `outbox-relay...`), with the CPU ticks each has used so far.
async fn relay_sessions(
    client: &tokio_postgres::Client,
) -> anyhow::Result<std::collections::HashMap<u32, u64>> {
    let rows = client
        .query(
            "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'outbox-relay%'",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .filter_map(|r| {
            let pid = r.get::<_, i32>(0) as u32;
            outbox_tests::process::stat_of(pid).map(|(_, ticks)| (pid, ticks))
        })
        .collect())
}

/// The CPU the sessions of `to` used since `from`: all of it for a session
/// that opened in between. A session that closed in between is not counted.
fn sessions_cpu_since(
    from: &std::collections::HashMap<u32, u64>,
    to: &std::collections::HashMap<u32, u64>,
) -> Duration {
    let ticks: u64 = to
        .iter()
        .map(|(pid, t)| t.saturating_sub(from.get(pid).copied().unwrap_or(0)))
        .sum();
    Duration::from_millis(ticks * 10)
}

/// The value at fraction `p` of sorted `sorted`.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// How `latency` runs, apart from its rates.
struct Latency {
    seconds: u64,
    keys: usize,
    /// Writer connections, each committing its share of the rate in turn.
    writers: usize,
    /// Messages each writer's transaction commits.
    per_tx: usize,
    notify: bool,
    broker: String,
    pin: bool,
    fetch_wait_ms: u64,
}

async fn latency(rates: &[u64], run: &Latency) -> anyhow::Result<()> {
    let Latency {
        seconds,
        keys,
        writers,
        per_tx,
        notify,
        ref broker,
        pin,
        fetch_wait_ms,
    } = *run;
    let broker = broker.as_str();
    let bin = release_relay_binary()?;
    let db = TestDb::new().await;
    outbox_client::set_notify(&db.client, db.schema.as_str(), notify).await?;
    let pinned = outbox_tests::db::connect(&db.config).await;
    if pin {
        pinned.batch_execute(outbox_tests::db::PIN_SNAPSHOT).await?;
        println!("a REPEATABLE READ snapshot is held open for the whole run");
    }
    // Commit instants by sequence number, and (sequence, receipt) pairs.
    let commits: Arc<Mutex<Vec<Option<Instant>>>> = Arc::new(Mutex::new(Vec::new()));
    let receipts: Arc<Mutex<Vec<(usize, Instant)>>> = Arc::new(Mutex::new(Vec::new()));
    let mut env: Vec<(&str, String)> = vec![("OUTBOX_SCHEMA", db.schema.to_string())];
    let mut rabbit = None;
    let destination = match broker {
        "kafka" => {
            let brokers = outbox_tests::kafka_brokers();
            let topic = outbox_tests::unique("benchwake");
            outbox_tests::kafka::create_topic(&brokers, &topic, 3).await;
            env.push(("OUTBOX_BROKER", "kafka".into()));
            env.push(("OUTBOX_KAFKA_BROKERS", brokers.clone()));
            let consumer: StreamConsumer = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                .set("group.id", outbox_tests::unique("benchwake"))
                .set("auto.offset.reset", "earliest")
                // tansu 0.6 holds every fetch for this long, records in
                // hand or not (tansu-storage, service/fetch.rs: the loop
                // sleeps out the rest of max_wait after each pass). A Kafka
                // broker answers once fetch.min.bytes is there, so on tansu
                // a longer wait adds to every receipt what Kafka would not:
                // 5 ms put p99 3-4 ms above 1 ms (docs/benchmarks.md).
                .set("fetch.wait.max.ms", fetch_wait_ms.to_string())
                .create()?;
            consumer.subscribe(&[topic.as_str()])?;
            let receipts = Arc::clone(&receipts);
            tokio::spawn(async move {
                let mut stream = consumer.stream();
                while let Some(Ok(m)) = stream.next().await {
                    let seq = seq_of(m.payload().unwrap_or_default());
                    receipts.lock().expect("lock").push((seq, Instant::now()));
                }
            });
            topic
        }
        _ => {
            let fixture = Fixture::new().await;
            let exchange = fixture.exchange.clone();
            rabbit = Some(fixture);
            exchange
        }
    };
    let http_port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    // Where a batch's time goes: the relay's own histograms, as (sum,
    // count) pairs, in the order of `STAGES`. The publish count is also
    // how many batches carried the messages.
    let stages = || async move {
        let text = outbox_tests::http::scrape(http_port).await;
        STAGES.map(|(name, _)| {
            let part = |suffix: &str| {
                outbox_tests::http::sample(&text, &format!("{name}_{suffix}")).unwrap_or(0.0)
            };
            (part("sum"), part("count"))
        })
    };
    let mut relay = tokio::process::Command::new(&bin)
        .arg("run")
        .env("OUTBOX_DATABASE_URL", outbox_tests::pg_url())
        .env("OUTBOX_AMQP_URL", outbox_tests::amqp_url())
        .env("OUTBOX_HTTP_ADDR", format!("127.0.0.1:{http_port}"))
        .env("OUTBOX_LOG", "warn")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let pid = relay.id().unwrap_or(0);
    // Idle: connected, partitions taken, nothing to do.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle_from = cpu_time_of(pid).unwrap_or_default();
    let idle_for = Duration::from_secs(10);
    tokio::time::sleep(idle_for).await;
    let idle_cpu = cpu_time_of(pid).unwrap_or_default() - idle_from;
    println!(
        "broker={broker} relay {} with its defaults, NOTIFY {}, 1 KiB messages over {keys} keys, {writers} writer connections, {per_tx} per transaction, {seconds}s per rate{}",
        bin.display(),
        if notify { "on" } else { "off" },
        if broker == "kafka" {
            format!("; consumer's fetch.wait.max.ms {fetch_wait_ms}")
        } else {
            String::new()
        }
    );
    println!(
        "idle relay: {:.2}% of a core over {}s",
        idle_cpu.as_secs_f64() / idle_for.as_secs_f64() * 100.0,
        idle_for.as_secs()
    );
    println!(
        "{:>8} {:>9} {:>9} {:>9} {:>9} {:>14} {:>10}",
        "rate/s", "sent", "p50 ms", "p99 ms", "max ms", "CPU s per 10k", "per batch"
    );
    let mut next_seq = 0usize;
    for &rate in rates {
        let total = (rate * seconds) as usize;
        commits.lock().expect("lock").resize(next_seq + total, None);
        let cpu_from = cpu_time_of(pid).unwrap_or_default();
        let stages_from = stages().await;
        // Counted, not copied: a copy of every delivery each time round the
        // wait below would take the machine from the relay it measures.
        let received = || match &rabbit {
            Some(f) => f.count(),
            None => receipts.lock().expect("lock").len(),
        };
        let received_before = received();
        // Every program's CPU over the phase, and the machine's idle share:
        // a rate the writers cannot keep on a machine left without idle
        // time is the machine's limit, not the relay's.
        let relay_sessions_from = relay_sessions(&db.client).await?;
        let watch = outbox_tests::cpu::CpuWatch::start(&[
            "postgres",
            if broker == "kafka" {
                "tansu"
            } else {
                "beam.smp"
            },
            "outbox-relay",
            "self",
        ]);
        let started = Instant::now();
        let mut tasks = Vec::new();
        for w in 0..writers {
            let config = db.config.clone();
            let outbox = db.outbox();
            let destination = destination.clone();
            let commits = Arc::clone(&commits);
            let base = next_seq;
            tasks.push(tokio::spawn(async move {
                let mut client = outbox_tests::db::connect(&config).await;
                // Transactions carry `per_tx` consecutive sequence numbers
                // each; writer w commits transactions w, w + writers, ...,
                // and the i-th message of all is due at started + i / rate.
                let mut t = w;
                while t * per_tx < total {
                    let first = t * per_tx;
                    let due = started + Duration::from_secs_f64(first as f64 / rate as f64);
                    tokio::time::sleep_until(due.into()).await;
                    let seqs = base + first..base + (first + per_tx).min(total);
                    let messages = seqs
                        .clone()
                        .map(|seq| {
                            let mut payload = format!("{seq:>12}").into_bytes();
                            payload.resize(PAYLOAD, b'x');
                            Message::builder(destination.as_str())
                                .key(format!("k{}", seq % keys))
                                .payload(payload)
                                .build()
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    let tx = client.transaction().await?;
                    if let [one] = messages.as_slice() {
                        outbox.enqueue(&tx, one).await?;
                    } else {
                        outbox.enqueue_batch(&tx, &messages).await?;
                    }
                    tx.commit().await?;
                    let at = Instant::now();
                    let mut commits = commits.lock().expect("lock");
                    for seq in seqs {
                        commits[seq] = Some(at);
                    }
                    t += writers;
                }
                anyhow::Ok(())
            }));
        }
        for t in tasks {
            t.await??;
        }
        let wrote = started.elapsed();
        let wait_until = Instant::now() + Duration::from_secs(60);
        while received() < received_before + total && Instant::now() < wait_until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let cpu = cpu_time_of(pid).unwrap_or_default() - cpu_from;
        let split = watch.stop().await;
        let relay_sessions_cpu =
            sessions_cpu_since(&relay_sessions_from, &relay_sessions(&db.client).await?);
        let stages_to = stages().await;
        let batches = stages_to[PUBLISH_STAGE].1 - stages_from[PUBLISH_STAGE].1;
        let l = latencies(&rabbit, &receipts, &commits, next_seq);
        println!(
            "{:>8} {:>9} {:>9.1} {:>9.1} {:>9.1} {:>14.2} {:>10.1}   (writers kept {:.0}/s; {} received)",
            rate,
            total,
            percentile(&l, 0.5),
            percentile(&l, 0.99),
            l.last().copied().unwrap_or(f64::NAN),
            cpu.as_secs_f64() / total as f64 * 10_000.0,
            total as f64 / batches.max(1.0),
            total as f64 / wrote.as_secs_f64(),
            l.len()
        );
        let means: Vec<String> = STAGES
            .iter()
            .zip(stages_from.iter().zip(&stages_to))
            .map(|((_, label), ((sum0, n0), (sum1, n1)))| {
                let n = n1 - n0;
                let mean = if n > 0.0 {
                    (sum1 - sum0) / n * 1e3
                } else {
                    f64::NAN
                };
                format!("{label} {mean:.2} ms")
            })
            .collect();
        // Against the relay's insert to confirm (a little longer than commit
        // to confirm), this shows how long the broker took to hand a
        // confirmed message to the consumer.
        let mean = l.iter().sum::<f64>() / l.len().max(1) as f64;
        println!(
            "{:>8} means: {}; commit to consumer {mean:.2} ms",
            "",
            means.join(", ")
        );
        // `self` is the writers and the consumer; Postgres's share spent
        // in the relay's own sessions is what the relay costs the database.
        println!(
            "{:>8} {}; of postgres, the relay's sessions {:.1}",
            "",
            split.per_message(total),
            relay_sessions_cpu.as_secs_f64() * 1e6 / total as f64
        );
        next_seq += total;
    }
    println!(
        "relay peak RSS: {:.1} MiB",
        peak_rss_kib(pid).unwrap_or(0) as f64 / 1024.0
    );
    relay.kill().await?;
    if let Some(f) = rabbit {
        f.cleanup().await;
    }
    db.cleanup().await;
    Ok(())
}
