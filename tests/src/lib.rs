//! Harness for the end-to-end suites: fresh schemas, broker fixtures, a relay
//! process that can be killed, a writer workload and a delivery checker.
//!
//! Connection strings come from `OUTBOX_TEST_DATABASE_URL` and
//! `OUTBOX_TEST_AMQP_URL`, defaulting to this machine's local services.

pub mod amqp;
pub mod cgroup;
pub mod check;
pub mod claim;
pub mod cluster;
pub mod cpu;
pub mod db;
pub mod http;
pub mod idempotency;
pub mod kafka;
pub mod pgbouncer;
pub mod process;
pub mod proxy;
pub mod python;
pub mod sink;
pub mod tls;
pub mod workload;

/// In every workload payload (tests/src/workload.rs); never in a log.
pub const PAYLOAD_SENTINEL: &str = "payload-sentinel-5d1e";
/// The Postgres password every [`process::RelayProcess`] is given (trust
/// authentication ignores it); never in a log.
pub const PASSWORD_SENTINEL: &str = "pw-sentinel-93b0";

/// Postgres URL for tests.
pub fn pg_url() -> String {
    std::env::var("OUTBOX_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// AMQP URL for tests.
pub fn amqp_url() -> String {
    std::env::var("OUTBOX_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// Kafka bootstrap servers for tests.
pub fn kafka_brokers() -> String {
    std::env::var("OUTBOX_TEST_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".to_owned())
}

/// A TCP port on 127.0.0.1 that was free a moment ago (bound, then released),
/// for a listener the test or a process it starts will bind. Another process
/// can take it in between, so a caller that must be sure retries.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// A short random lowercase suffix for schema, exchange and queue names.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// `size` bytes of random hex digits: a key that does not compress, as a
/// hash or an encrypted id would not, to test limits set by an index.
pub fn random_hex(size: usize) -> String {
    let mut key = String::with_capacity(size + 32);
    while key.len() < size {
        key.push_str(&uuid::Uuid::new_v4().simple().to_string());
    }
    key.truncate(size);
    key
}

/// `n` envelopes for `destination`, as a claim would hand them to a
/// publisher: sequence numbers from 0, ordering keys `k0`..`k{keys-1}` in
/// turn, the sequence number as the payload.
pub fn envelopes(destination: &str, n: i64, keys: i64) -> Vec<outbox_relay::publish::Envelope> {
    (0..n)
        .map(|seq| outbox_relay::publish::Envelope {
            seq,
            message_id: uuid::Uuid::now_v7(),
            destination: destination.to_owned(),
            ordering_key: Some(format!("k{}", seq % keys)),
            routing_key: String::new(),
            headers: Vec::new(),
            payload: seq.to_string().into_bytes(),
            content_type: None,
            event_type: None,
            created_at: std::time::SystemTime::now(),
            attempts: 0,
        })
        .collect()
}

/// The median of `v` (the mean of the middle two for an even count), for
/// benchmarks that report the middle of several rounds.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len().is_multiple_of(2) {
        (v[mid - 1] + v[mid]) / 2.0
    } else {
        v[mid]
    }
}

/// The seed for a test's random mix: `OUTBOX_TEST_SEED` to replay one, else
/// a fresh one, drawn once per test binary so that every draw of a run (the
/// scenario's mix and the writers' workload, see [`workload`]) comes from
/// it. Printed, so a failure's output says how to replay it.
pub fn seed() -> u64 {
    use rand::Rng;
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let seed = *SEED.get_or_init(|| {
        std::env::var("OUTBOX_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| rand::rng().random())
    });
    eprintln!("OUTBOX_TEST_SEED={seed}");
    seed
}

/// Logs to the test's output when `OUTBOX_LOG` is set (e.g. `OUTBOX_LOG=debug`).
pub fn init_logging() {
    if let Ok(filter) = std::env::var("OUTBOX_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_test_writer()
            .try_init();
    }
}

/// Polls `probe` every 50 ms until it returns true or `limit` passes; returns
/// the last answer. Limits here are generous ceilings on a wait, never the
/// thing a test asserts about speed.
pub async fn eventually<F, Fut>(limit: std::time::Duration, mut probe: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if probe().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// A relay running in this process (for tests that do not kill it).
pub struct InProcessRelay {
    shutdown: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<Result<(), outbox_relay::Error>>,
    /// Its counters.
    pub stats: std::sync::Arc<outbox_relay::Stats>,
    /// Its claim floor.
    pub floor: std::sync::Arc<outbox_relay::source::floor::Floor>,
    publisher: std::sync::Arc<dyn std::any::Any + Send + Sync>,
}

impl InProcessRelay {
    /// Starts a RabbitMQ relay on `db`'s schema.
    pub fn amqp(db: &db::TestDb, settings: outbox_relay::Settings) -> InProcessRelay {
        Self::amqp_on(db.config.clone(), db, settings)
    }

    /// Starts a RabbitMQ relay on `db`'s schema that reaches Postgres
    /// through `database` (e.g. with session options of its own).
    pub fn amqp_on(
        database: impl Into<outbox_relay::source::Database>,
        db: &db::TestDb,
        settings: outbox_relay::Settings,
    ) -> InProcessRelay {
        let publisher = outbox_relay::publish::amqp::AmqpPublisher::new(
            outbox_relay::publish::amqp::AmqpSettings {
                url: amqp_url(),
                confirm_timeout: std::time::Duration::from_secs(10),
                connect_timeout: std::time::Duration::from_secs(5),
                ca_pem: None,
            },
        );
        Self::on(database, db, publisher, settings)
    }

    /// Starts a Kafka relay on `db`'s schema, producing to `brokers`.
    pub fn kafka(
        db: &db::TestDb,
        brokers: &str,
        properties: &[(&str, &str)],
        settings: outbox_relay::Settings,
    ) -> InProcessRelay {
        let publisher = outbox_relay::publish::kafka::KafkaPublisher::new(
            outbox_relay::publish::kafka::KafkaSettings {
                brokers: brokers.to_owned(),
                properties: properties
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
                message_timeout: std::time::Duration::from_secs(10),
                in_flight: outbox_relay::publish::kafka::InFlight {
                    pipeline: settings.pipeline,
                    batch_size: usize::try_from(settings.batch_size).unwrap_or(usize::MAX),
                    batch_bytes: usize::try_from(settings.batch_max_bytes).unwrap_or(usize::MAX),
                },
            },
        )
        .expect("valid kafka settings");
        Self::with(db, publisher, settings)
    }

    /// Starts a relay with any publisher.
    pub fn with<P: outbox_relay::publish::Publisher>(
        db: &db::TestDb,
        publisher: P,
        settings: outbox_relay::Settings,
    ) -> InProcessRelay {
        Self::on(db.config.clone(), db, publisher, settings)
    }

    /// Starts a relay on `db`'s schema that reaches Postgres through
    /// `database` (e.g. a TLS connection string).
    pub fn on<P: outbox_relay::publish::Publisher>(
        database: impl Into<outbox_relay::source::Database>,
        db: &db::TestDb,
        publisher: P,
        settings: outbox_relay::Settings,
    ) -> InProcessRelay {
        let relay = outbox_relay::Relay::new(database, db.schema.clone(), publisher, settings);
        let stats = relay.stats();
        let floor = relay.floor();
        let publisher = relay.publisher();
        let shutdown = tokio_util::sync::CancellationToken::new();
        let task = tokio::spawn(relay.run(shutdown.clone()));
        InProcessRelay {
            shutdown,
            task,
            stats,
            floor,
            publisher,
        }
    }

    /// Its publisher, as the type it was started with.
    pub fn publisher<P: outbox_relay::publish::Publisher>(&self) -> std::sync::Arc<P> {
        std::sync::Arc::clone(&self.publisher)
            .downcast::<P>()
            .expect("the relay was started with another publisher type")
    }

    /// Samples, every 100 ms for `outage`, whether the relay reports the
    /// broker down, and panics if, once down, it is reported back or down
    /// anew (a new down-since) before `outage` ends: an operator's "down
    /// for more than N minutes" must be able to fire. Panics too if it was
    /// never reported down.
    pub async fn assert_broker_stays_down(&self, outage: std::time::Duration) {
        let started = std::time::Instant::now();
        let mut first_down = None;
        while started.elapsed() < outage {
            let down = self.stats.broker_down().map(|(since, _)| since);
            match (first_down, down) {
                (None, Some(since)) => first_down = Some(since),
                (Some(first), now) => assert_eq!(
                    now,
                    Some(first),
                    "{:?} into the outage: the broker was reported back, or down anew",
                    started.elapsed()
                ),
                (None, None) => {}
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        assert!(
            first_down.is_some(),
            "an outage of {outage:?} never showed as the broker down"
        );
    }

    /// Requests shutdown and waits for a clean stop.
    pub async fn stop(self) {
        self.shutdown.cancel();
        self.task
            .await
            .expect("relay task panicked")
            .expect("relay returned an error");
    }
}

/// Settings with a short poll interval and retry delays, for tests.
pub fn fast_settings() -> outbox_relay::Settings {
    outbox_relay::Settings {
        poll_interval: std::time::Duration::from_millis(200),
        retry_base: std::time::Duration::from_millis(100),
        retry_max: std::time::Duration::from_secs(1),
        reconnect_max: std::time::Duration::from_secs(1),
        ..outbox_relay::Settings::default()
    }
}

/// Converts AMQP deliveries for the checker.
pub fn seen_amqp(deliveries: &[amqp::Delivery]) -> Vec<check::Seen> {
    deliveries
        .iter()
        .map(|d| check::Seen {
            message_id: d.message_id.clone(),
            payload: d.payload.clone(),
        })
        .collect()
}

/// Converts Kafka records for the checker.
pub fn seen_kafka(records: &[kafka::Record]) -> Vec<check::Seen> {
    records
        .iter()
        .map(|r| check::Seen {
            message_id: r.headers.get("message-id").cloned().unwrap_or_default(),
            payload: r.payload.clone(),
        })
        .collect()
}
