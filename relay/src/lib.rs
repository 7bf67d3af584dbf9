//! The outbox relay: finds committed outbox rows and publishes them at least once.
//!
//! ```text
//! app tx: domain rows + outbox row ──commit──▶ outbox table
//!                                                │ NOTIFY (wake-up) + polling (guarantee)
//!                                                ▼
//!                     claim batch (FOR UPDATE SKIP LOCKED, head-of-key)
//!                                                │
//!                     publish batch, await the broker's confirms
//!                                                │
//!                     delete confirmed rows, record failures, commit
//! ```
//!
//! `main` parses flags into a [`config::Config`] and calls [`run`]; tests and
//! embedders build a [`Relay`] with any [`publish::Publisher`].

#![warn(missing_docs, unreachable_pub)]

pub mod backoff;
pub mod cli;
pub mod config;
pub mod demo;
pub mod endpoints;
pub mod engine;
pub mod envelope;
pub mod health;
pub mod metrics;
#[cfg(feature = "mutants")]
pub mod mutants;
pub mod ops;
pub mod publish;
pub mod redact;
pub mod source;
pub mod supervise;
pub mod timefmt;

use tokio_util::sync::CancellationToken;

/// How long open HTTP connections may hold up the exit once the relay has
/// stopped.
const HTTP_CLOSE: std::time::Duration = std::time::Duration::from_secs(2);

pub use engine::{Relay, Settings};
pub use health::Stats;

/// Why the relay stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The outbox tables are not there.
    #[error("outbox schema {schema:?} is not migrated; run `outbox-relay migrate` first ({})", source::PgError(.cause))]
    SchemaMissing {
        /// The configured schema.
        schema: String,
        /// What Postgres said (shown in the message, not repeated as a
        /// source, so a one-line report prints it once).
        cause: tokio_postgres::Error,
    },
    /// A configuration value is unusable.
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    /// A client-library operation (migration, notify switch) failed.
    #[error(transparent)]
    Client(#[from] outbox_client::Error),
    /// A database operation outside the relay loop failed.
    #[error("postgres: {}", source::PgError(.0))]
    Postgres(tokio_postgres::Error),
    /// The connection is not a session of its own (a transaction pooler).
    #[error(transparent)]
    Session(#[from] source::SessionError),
    /// One of the relay's own tasks (ownership, LISTEN, the durability
    /// barrier, ...) ended before shutdown, a bug; the relay stopped rather
    /// than run on without it.
    #[error("the relay's {task} task {how}; stopped so that it can be restarted")]
    TaskEnded {
        /// Which task.
        task: &'static str,
        /// "ended", or "panicked: <message>".
        how: String,
    },
}

impl From<tokio_postgres::Error> for Error {
    fn from(e: tokio_postgres::Error) -> Self {
        Error::Postgres(e)
    }
}

/// Runs the relay described by `config` until `shutdown` is cancelled, with
/// `/metrics`, `/healthz` and `/readyz` on the configured HTTP address.
pub async fn run(config: config::Config, shutdown: CancellationToken) -> Result<(), Error> {
    match config.broker.clone() {
        config::Broker::Amqp(amqp) => {
            let mut publisher = publish::amqp::AmqpPublisher::new(amqp);
            if let Some(ce) = config.cloudevents.clone() {
                publisher = publisher.with_cloudevents(ce);
            }
            serve_relay(config, publisher, shutdown).await
        }
        config::Broker::Kafka(kafka) => {
            let mut publisher =
                publish::kafka::KafkaPublisher::new(kafka).map_err(|e| config::ConfigError {
                    flag: "--kafka-config",
                    reason: config::kafka_client_error(e),
                })?;
            if let Some(ce) = config.cloudevents.clone() {
                publisher = publisher.with_cloudevents(ce);
            }
            serve_relay(config, publisher, shutdown).await
        }
    }
}

async fn serve_relay<P: publish::Publisher>(
    config: config::Config,
    publisher: P,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let park = config.settings.park_on_dead_letter;
    let relay = Relay::new(
        config.pg.clone(),
        config.schema.clone(),
        publisher,
        config.settings,
    );
    let stats = relay.stats();
    let mut helpers = Vec::new();
    if let Some(addr) = config.http_addr {
        let listener = endpoints::bind(addr)
            .await
            .map_err(|e| config::ConfigError {
                flag: "--http-addr",
                reason: format!("cannot listen on {addr}: {e}"),
            })?;
        let broker = match &config.broker {
            config::Broker::Amqp(_) => "amqp",
            config::Broker::Kafka(_) => "kafka",
        };
        let handle = metrics::install(broker).map_err(|reason| config::ConfigError {
            flag: "--http-addr",
            reason: format!("cannot install the metrics recorder: {reason}"),
        })?;
        let local = listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        tracing::info!(addr = %local, "serving /metrics, /healthz, /readyz");
        let stop = CancellationToken::new();
        let db_gauges = endpoints::SharedDbGauges::default();
        helpers.push(tokio::spawn(endpoints::serve(
            listener,
            handle,
            std::sync::Arc::clone(&stats),
            std::sync::Arc::clone(&db_gauges),
            stop.clone(),
        )));
        helpers.push(tokio::spawn(endpoints::collect(
            config.pg,
            config.schema,
            std::sync::Arc::clone(&stats),
            db_gauges,
            park,
            std::time::Duration::from_secs(5),
            stop.clone(),
        )));
        let result = relay.run(shutdown).await;
        // The endpoints outlive the relay loop so probes see the drain.
        stop.cancel();
        // Their graceful shutdown closes idle connections and waits for
        // the rest without a timer: a request half sent (a stalled
        // scraper, a peer gone without a FIN) kept the relay from exiting
        // after its drain, and from exiting 1 after a failed task. They get
        // a moment, then go with the process.
        let helpers = futures::future::join_all(helpers);
        if tokio::time::timeout(HTTP_CLOSE, helpers).await.is_err() {
            tracing::warn!(
                "the endpoints (an HTTP connection still open, or the gauges' read) had not ended {HTTP_CLOSE:?} after shutdown; exiting without them"
            );
        }
        return result;
    }
    relay.run(shutdown).await
}

/// Connects to Postgres through `db` and applies the migrations to `schema`.
pub async fn migrate(
    db: &source::Database,
    schema: &outbox_client::SchemaName,
) -> Result<(), Error> {
    // The migration holds a session advisory lock and sets search_path.
    source::check_session(db).await?;
    let (mut client, connection) = db.connect().await?;
    let driver = tokio::spawn(connection);
    outbox_client::migrate(&mut client, schema.as_str()).await?;
    drop(client);
    let _ = driver.await;
    Ok(())
}
