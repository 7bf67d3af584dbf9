//! Command line and environment, validated once into a [`Config`].
//!
//! Every flag has an `OUTBOX_...` environment variable. Secrets (the database and
//! broker URLs) can also come from a file named by the `..._FILE` variant, and
//! are never echoed: `--help` hides their values and logs redact them.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use outbox_client::SchemaName;

use crate::engine::Settings;
use crate::redact::redact_url;

/// Relays committed outbox rows to a broker, at least once, each stamped with a
/// stable message id.
#[derive(Debug, Parser)]
#[command(name = "outbox-relay", version, about, propagate_version = true)]
pub struct Cli {
    /// Log format.
    #[arg(long, env = "OUTBOX_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Relay committed outbox rows to the broker until SIGTERM or Ctrl-C.
    Run(Box<RunArgs>),
    /// Create the outbox schema or bring it up to date (safe to run concurrently).
    Migrate(MigrateArgs),
    /// Show the whole path working against the local Postgres and RabbitMQ.
    Demo(DemoArgs),
    /// Backlog, retries, dead letters, parked keys, replicas and their
    /// partitions, and what is holding the relay back.
    Status {
        /// Where the outbox lives.
        #[command(flatten)]
        db: DbArgs,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Inspect, retry or discard dead-lettered messages.
    DeadLetters {
        /// Where the outbox lives.
        #[command(flatten)]
        db: DbArgs,
        /// What to do.
        #[command(subcommand)]
        action: DeadLetterAction,
    },
    /// Where is message <ID>: pending, in flight, dead-lettered, or gone.
    Locate {
        /// Where the outbox lives.
        #[command(flatten)]
        db: DbArgs,
        /// The message id.
        id: uuid::Uuid,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Hold back one destination for every replica: its rows wait in the
    /// outbox (not claimed, no attempts counted) until `resume`. A key with a
    /// message for it waits there too, so per-key order holds.
    Pause {
        /// Where the outbox lives.
        #[command(flatten)]
        db: DbArgs,
        /// The destination (AMQP exchange or Kafka topic).
        destination: String,
        /// Why, shown by `status`.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Let a paused destination flow again, at once on every replica.
    Resume {
        /// Where the outbox lives.
        #[command(flatten)]
        db: DbArgs,
        /// The destination.
        destination: String,
    },
    /// Ask the relay on this host whether it works: exit 0 when /healthz (or,
    /// with --ready, /readyz) answers 200, 1 otherwise. For a container
    /// HEALTHCHECK in an image without curl.
    Healthcheck {
        /// The relay's --http-addr; an unspecified address (0.0.0.0, ::) is
        /// asked on loopback.
        #[arg(long, env = "OUTBOX_HTTP_ADDR", default_value = "0.0.0.0:9839", value_parser = parse_http_addr)]
        http_addr: HttpAddr,
        /// Ask /readyz instead of /healthz.
        #[arg(long)]
        ready: bool,
        /// Longest wait for the answer.
        #[arg(long, default_value = "3s", value_parser = parse_duration)]
        timeout: Duration,
    },
    /// Switch the insert trigger's NOTIFY on or off (polling still finds rows).
    Notify {
        /// Database to change.
        #[command(flatten)]
        db: DbArgs,
        /// on or off.
        #[arg(value_enum)]
        state: Switch,
    },
}

/// Which dead letters a `dead-letters` command acts on.
#[derive(Debug, Clone, Default, Args)]
pub struct FilterArgs {
    /// Only this message id.
    #[arg(long)]
    pub id: Option<uuid::Uuid>,
    /// Only this ordering key.
    #[arg(long)]
    pub key: Option<String>,
    /// Only this destination.
    #[arg(long)]
    pub destination: Option<String>,
    /// Only those dead-lettered at or after this time (RFC 3339, e.g. 2026-11-29T10:00:00Z).
    #[arg(long, value_parser = parse_time)]
    pub since: Option<std::time::SystemTime>,
    /// Every dead letter (required by retry/discard when no other filter is given).
    #[arg(long)]
    pub all: bool,
}

fn parse_time(s: &str) -> Result<std::time::SystemTime, String> {
    humantime::parse_rfc3339_weak(s)
        .map_err(|e| format!("{e} (use RFC 3339, e.g. 2026-11-29T10:00:00Z)"))
}

impl From<FilterArgs> for crate::ops::Filter {
    fn from(f: FilterArgs) -> Self {
        crate::ops::Filter {
            id: f.id,
            key: f.key,
            destination: f.destination,
            since: f.since,
            all: f.all,
        }
    }
}

/// `dead-letters` subcommands.
#[derive(Debug, Subcommand)]
pub enum DeadLetterAction {
    /// List dead letters (oldest first).
    List {
        /// Which ones.
        #[command(flatten)]
        filter: FilterArgs,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Show one dead letter in full (payload size, headers, error).
    Show {
        /// The message id.
        id: uuid::Uuid,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// Include the payload: as text when it is UTF-8, else as hex (the
        /// JSON says which in `payload.encoding`).
        #[arg(long)]
        payload: bool,
    },
    /// Return dead letters to the outbox in their original order; unparks their keys.
    Retry {
        /// Which ones.
        #[command(flatten)]
        filter: FilterArgs,
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Delete dead letters for good.
    Discard {
        /// Which ones.
        #[command(flatten)]
        filter: FilterArgs,
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// on/off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Switch {
    /// Enabled.
    On,
    /// Disabled.
    Off,
}

/// A secret URL: Debug and Display show it with the password masked.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretUrl(String);

impl SecretUrl {
    /// The URL with its password, for connecting.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", redact_url(&self.0))
    }
}

impl fmt::Display for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact_url(&self.0))
    }
}

fn parse_pg_url(s: &str) -> Result<SecretUrl, String> {
    crate::source::Database::check_url(s)
        .map(|_| SecretUrl(s.to_owned()))
        // The messages name the offending part, never the password.
        .map_err(|e| e.to_string())
}

fn parse_amqp_url(s: &str) -> Result<SecretUrl, String> {
    lapin::uri::AMQPUri::from_str(s)
        .map(|_| SecretUrl(s.to_owned()))
        .map_err(|e| format!("not an amqp:// or amqps:// URL: {e}"))
}

/// An HTTP listen address, or off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpAddr(pub Option<std::net::SocketAddr>);

fn parse_http_addr(s: &str) -> Result<HttpAddr, String> {
    if s.eq_ignore_ascii_case("off") {
        return Ok(HttpAddr(None));
    }
    s.parse()
        .map(|a| HttpAddr(Some(a)))
        .map_err(|e| format!("{e} (use host:port, e.g. 0.0.0.0:9839, or off)"))
}

fn parse_schema(s: &str) -> Result<SchemaName, String> {
    SchemaName::new(s).map_err(|e| e.to_string())
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e} (use a unit, e.g. 250ms, 5s, 1m)"))
}

/// A byte count: a plain number, or one with a unit (KiB, MiB, GiB; KB, MB,
/// GB; B). At least 1.
fn parse_bytes(s: &str) -> Result<i64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let n: i64 = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a byte count (e.g. 8MiB, 512KiB, 1048576)"))?;
    let scale: i64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        other => {
            return Err(format!(
                "unknown unit {other:?} (use B, KiB, MiB, GiB, KB, MB or GB)"
            ))
        }
    };
    match n.checked_mul(scale) {
        Some(v) if v >= 1 => Ok(v),
        _ => Err(format!("{s:?} must be at least 1 byte and fit in 63 bits")),
    }
}

/// Where the outbox lives.
#[derive(Debug, Clone, Args)]
pub struct DbArgs {
    /// Postgres URL or key=value connection string. `run` waits for a
    /// Postgres that is down, restarting or out of connections; one that
    /// refuses the password, user or database stops it at start-up with the
    /// server's message (once running, every error is retried). For TLS add
    /// `sslmode=verify-full` (or `require`; either way the certificate and host
    /// name are verified) and `sslrootcert=<ca.pem>` unless the system's roots
    /// apply.
    #[arg(
        long,
        env = "OUTBOX_DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/postgres",
        value_parser = parse_pg_url,
        global = true
    )]
    pub database_url: SecretUrl,
    /// Read the Postgres URL from this file instead (e.g. a mounted secret).
    #[arg(long, env = "OUTBOX_DATABASE_URL_FILE", global = true)]
    pub database_url_file: Option<PathBuf>,
    /// Schema holding the outbox tables; lets several outboxes share a database.
    #[arg(long, env = "OUTBOX_SCHEMA", default_value = SchemaName::DEFAULT, value_parser = parse_schema, global = true)]
    pub schema: SchemaName,
}

impl DbArgs {
    /// The connection settings, with the `_FILE` variant applied.
    pub fn database(&self) -> Result<crate::source::Database, ConfigError> {
        let url = match &self.database_url_file {
            Some(path) => read_secret("--database-url-file", path, parse_pg_url)?,
            None => self.database_url.clone(),
        };
        crate::source::Database::from_url(url.expose()).map_err(|e| ConfigError {
            flag: "--database-url",
            reason: e.to_string(),
        })
    }
}

/// A configuration problem found at start-up, naming the flag.
#[derive(Debug, thiserror::Error)]
#[error("invalid value for {flag}: {reason}")]
pub struct ConfigError {
    /// The flag at fault.
    pub flag: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

fn read_secret(
    flag: &'static str,
    path: &PathBuf,
    parse: fn(&str) -> Result<SecretUrl, String>,
) -> Result<SecretUrl, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
        flag,
        reason: format!("cannot read {}: {e}", path.display()),
    })?;
    parse(text.trim()).map_err(|reason| ConfigError { flag, reason })
}

fn read_ca_file(flag: &'static str, path: &PathBuf) -> Result<String, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
        flag,
        reason: format!("cannot read {}: {e}", path.display()),
    })?;
    if !text.contains("-----BEGIN CERTIFICATE-----") {
        return Err(ConfigError {
            flag,
            reason: format!("{} holds no PEM certificate", path.display()),
        });
    }
    Ok(text)
}

/// The broker to publish to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BrokerKind {
    /// RabbitMQ, or any AMQP 0-9-1 broker with publisher confirms.
    Amqp,
    /// Kafka, or any Kafka-protocol broker.
    Kafka,
}

/// One librdkafka property, `key=value`.
#[derive(Clone, PartialEq, Eq)]
pub struct KafkaProperty(pub String, pub String);

impl fmt::Debug for KafkaProperty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown = if crate::publish::kafka::is_secret(&self.0) {
            "***"
        } else {
            &self.1
        };
        write!(f, "{}={}", self.0, shown)
    }
}

fn parse_kafka_property(s: &str) -> Result<KafkaProperty, String> {
    match s.split_once('=') {
        // The relay's guarantees rest on these two; they are not negotiable.
        Some((k, v)) if k.trim() == "acks" && !matches!(v.trim(), "all" | "-1") => Err(format!(
            "acks={} lets the broker confirm records it can still lose; the relay needs acks=all",
            v.trim()
        )),
        Some((k, v)) if k.trim() == "enable.idempotence" && v.trim() != "true" => Err(
            "enable.idempotence must stay true: without it librdkafka's retries can reorder or \
             duplicate records within a partition"
                .to_owned(),
        ),
        Some((k, v)) if !k.trim().is_empty() => {
            Ok(KafkaProperty(k.trim().to_owned(), v.to_owned()))
        }
        // Never echo the input: it may be a secret.
        _ => Err("expected key=value, e.g. compression.type=lz4".to_owned()),
    }
}

/// Splits `--kafka-config` values into properties: at newlines, and at a
/// comma when the text after it holds an `=` before the next comma (a value
/// may itself be a comma-separated list, like `ssl.cipher.suites`).
fn split_kafka_properties(values: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    for line in values.iter().flat_map(|v| v.lines()) {
        let mut current = String::new();
        for piece in line.split(',') {
            if piece.trim().is_empty() {
                continue;
            }
            let starts_property = piece.contains('=');
            if !current.is_empty() && !starts_property {
                current.push(',');
                current.push_str(piece);
                continue;
            }
            if !current.trim().is_empty() {
                out.push(std::mem::take(&mut current));
            }
            current = piece.to_owned();
        }
        if !current.trim().is_empty() {
            out.push(current);
        }
    }
    out
}

/// Reads `--kafka-config-file`: key=value lines, blank lines and `#`
/// comments ignored. Errors name the line, never its text.
fn read_kafka_config_file(path: &PathBuf) -> Result<Vec<(String, String)>, ConfigError> {
    const FLAG: &str = "--kafka-config-file";
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
        flag: FLAG,
        reason: format!("cannot read {}: {e}", path.display()),
    })?;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let p = parse_kafka_property(line).map_err(|reason| ConfigError {
            flag: FLAG,
            reason: format!("{} line {}: {reason}", path.display(), n + 1),
        })?;
        out.push((p.0, p.1));
    }
    Ok(out)
}

/// Flags of `outbox-relay run`.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Where the outbox lives.
    #[command(flatten)]
    pub db: DbArgs,
    /// Broker to publish to.
    #[arg(long, env = "OUTBOX_BROKER", value_enum, default_value_t = BrokerKind::Amqp)]
    pub broker: BrokerKind,
    /// AMQP URL [default: amqp://guest:***@127.0.0.1:5672/%2f, RabbitMQ's local guest account].
    #[arg(
        long,
        env = "OUTBOX_AMQP_URL",
        hide_env_values = true,
        hide_default_value = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        value_parser = parse_amqp_url
    )]
    pub amqp_url: SecretUrl,
    /// Read the AMQP URL from this file instead.
    #[arg(long, env = "OUTBOX_AMQP_URL_FILE")]
    pub amqp_url_file: Option<PathBuf>,
    /// Extra CA certificates (PEM) trusted for `amqps://`, besides the
    /// system's. The broker's certificate and host name are always verified.
    #[arg(long, env = "OUTBOX_AMQP_CA_FILE")]
    pub amqp_ca_file: Option<PathBuf>,
    /// Kafka bootstrap servers (host:port, comma-separated).
    #[arg(long, env = "OUTBOX_KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    pub kafka_brokers: String,
    /// Any librdkafka producer property, as key=value; repeatable. Several
    /// may share one value (or the env var), separated by newlines or commas;
    /// a comma starts a new property only when the text after it has an `=`
    /// before the next comma, so `ssl.cipher.suites=A,B,linger.ms=5` is two
    /// properties. Applied last, so it overrides the relay's defaults (SASL,
    /// TLS, compression, linger, ...). Values of password/secret properties
    /// are never logged.
    // Parsed in into_config, not by clap: clap's error would echo the raw
    // value, which may be a secret.
    #[arg(
        long = "kafka-config",
        env = "OUTBOX_KAFKA_CONFIG",
        hide_env_values = true
    )]
    pub kafka_config: Vec<String>,
    /// A file of librdkafka properties, one key=value per line (`#` starts a
    /// comment): the place for secrets such as `sasl.password`, mounted from
    /// a secret store. Applied after --kafka-config.
    #[arg(long, env = "OUTBOX_KAFKA_CONFIG_FILE")]
    pub kafka_config_file: Option<PathBuf>,
    /// Rows per batch. 500 keeps a batch's confirms within tens of milliseconds
    /// while amortizing the claim and delete round trips.
    #[arg(long, env = "OUTBOX_BATCH_SIZE", default_value_t = 500,
          value_parser = clap::value_parser!(i64).range(1..=10_000))]
    pub batch_size: i64,
    /// Payload bytes per batch (e.g. 8MiB, 512KiB, or a plain number): a
    /// claim stops adding rows when the next would pass it, and a single
    /// larger message goes alone. With pipeline + 1 batches claimed at once,
    /// the relay holds at most about (pipeline + 1) x this in payloads, plus
    /// one message over it; keep that well under the container's memory
    /// limit (the defaults, 4 x 8 MiB, fit a 256 MiB limit with room). It also
    /// keeps a Kafka batch inside librdkafka's local queue (64 MiB).
    #[arg(long, env = "OUTBOX_BATCH_MAX_BYTES", default_value = "8MiB", value_parser = parse_bytes)]
    pub batch_max_bytes: i64,
    /// Batches at the broker (published, awaiting confirms) at once: the
    /// confirm window. pipeline + 1 workers, each with its own Postgres
    /// connection, claim and settle around them, so a batch is ready whenever
    /// a slot frees. 3 keeps the broker busy; a crash can repeat at most
    /// pipeline + 1 batches.
    #[arg(long, env = "OUTBOX_PIPELINE", default_value_t = 3,
          value_parser = clap::value_parser!(u16).range(1..=32))]
    pub pipeline: u16,
    /// Longest pause between claims while the outbox is idle. Claims run back
    /// to back while they come back full; the pause starts at --poll-min and
    /// doubles with each empty claim up to this, so a message committed into an
    /// idle outbox waits at most this long. One worker polls while idle; the
    /// others stand by.
    #[arg(long, env = "OUTBOX_POLL_INTERVAL", default_value = "50ms", value_parser = parse_duration)]
    pub poll_interval: Duration,
    /// Shortest pause between claims, after one that took less than a full
    /// batch: a trickle goes out in batches of a few rather than one by one.
    #[arg(long, env = "OUTBOX_POLL_MIN", default_value = "5ms", value_parser = parse_duration)]
    pub poll_min: Duration,
    /// First retry delay after the broker rejects a message; doubles per attempt.
    #[arg(long, env = "OUTBOX_RETRY_BASE", default_value = "1s", value_parser = parse_duration)]
    pub retry_base: Duration,
    /// Cap on a rejected message's retry delay.
    #[arg(long, env = "OUTBOX_RETRY_MAX", default_value = "60s", value_parser = parse_duration)]
    pub retry_max: Duration,
    /// Cap on the delay between reconnect attempts to Postgres or the broker.
    #[arg(long, env = "OUTBOX_RECONNECT_MAX", default_value = "10s", value_parser = parse_duration)]
    pub reconnect_max: Duration,
    /// Longest wait for a batch's confirms; past it the broker connection is
    /// presumed dead, reopened, and the batch retried. On Kafka this is
    /// message.timeout.ms.
    #[arg(long, env = "OUTBOX_CONFIRM_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub confirm_timeout: Duration,
    /// How long in-flight batches may finish after SIGTERM before they are
    /// abandoned (and published again by the next run).
    #[arg(long, env = "OUTBOX_SHUTDOWN_GRACE", default_value = "5s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,
    /// Longest time a stalled relay keeps claimed rows locked before Postgres ends
    /// its session and frees them. Must exceed --confirm-timeout.
    #[arg(long, env = "OUTBOX_HOLD_LIMIT", default_value = "60s", value_parser = parse_duration)]
    pub hold_limit: Duration,
    /// How long a replica that stops answering keeps its partitions: the
    /// failover bound. A replica that dies outright hands them over at once.
    #[arg(long, env = "OUTBOX_LEASE", default_value = "5s", value_parser = parse_duration)]
    pub lease: Duration,
    /// Broker rejections (returns, nacks, unknown topic...) before a message is
    /// moved to the dead letters. Outages never count. Errors that can never
    /// succeed (e.g. too large) dead-letter at once.
    #[arg(long, env = "OUTBOX_MAX_ATTEMPTS", default_value_t = 10,
          value_parser = clap::value_parser!(i32).range(1..))]
    pub max_attempts: i32,
    /// Keep published messages this long, with their publish time and the
    /// broker's receipt (Kafka partition and offset, or the AMQP confirm), so
    /// `locate` can say where each went. "0s" (the default) deletes a row as
    /// soon as the broker confirms it.
    #[arg(long, env = "OUTBOX_RETENTION", default_value = "0s", value_parser = parse_duration)]
    pub retention: Duration,
    /// Rows deleted per statement when clearing published messages past
    /// --retention; small batches keep each delete's locks short.
    #[arg(long, env = "OUTBOX_RETENTION_CLEANUP_BATCH", default_value_t = 1000,
          value_parser = clap::value_parser!(i64).range(1..=100_000))]
    pub retention_cleanup_batch: i64,
    /// Address for /metrics (Prometheus), /healthz and /readyz; "off" disables.
    #[arg(long, env = "OUTBOX_HTTP_ADDR", default_value = "0.0.0.0:9839", value_parser = parse_http_addr)]
    pub http_addr: HttpAddr,
    /// What later messages of a dead-lettered message's key do: `park` (wait
    /// behind it, keeping order, until it is retried or discarded) or `skip`
    /// (go ahead without it).
    #[arg(long, env = "OUTBOX_DEAD_LETTER_ORDER", value_enum, default_value_t = DeadLetterOrder::Park)]
    pub dead_letter_order: DeadLetterOrder,
    /// Publish every message as a CloudEvent 1.0 in binary content mode: the
    /// payload as the body, `id`, `source`, `specversion`, `type` (the
    /// message's event type, else its destination) and `time` (its creation)
    /// as `ce_` headers on Kafka and `ce-` headers on RabbitMQ. Needs
    /// --cloudevents-source.
    #[arg(long, env = "OUTBOX_CLOUDEVENTS", requires = "cloudevents_source")]
    pub cloudevents: bool,
    /// The CloudEvents `source` of every event: a URI reference naming the
    /// producing service, e.g. `/orders-service`.
    #[arg(long, env = "OUTBOX_CLOUDEVENTS_SOURCE")]
    pub cloudevents_source: Option<String>,
}

/// What happens to a key's later messages when one is dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeadLetterOrder {
    /// Hold them back until the dead letter is retried or discarded.
    Park,
    /// Let them go ahead.
    Skip,
}

/// Flags of `outbox-relay migrate`.
#[derive(Debug, clap::Args)]
pub struct MigrateArgs {
    /// Database to migrate.
    #[command(flatten)]
    pub db: DbArgs,
    /// How long to wait for Postgres to accept connections (a database
    /// starting beside the relay, as in compose or a Kubernetes Job). Only an
    /// unreachable or starting server is waited for; a wrong password, user or
    /// database fails at once.
    #[arg(long, env = "OUTBOX_MIGRATE_WAIT", default_value = "60s", value_parser = parse_duration)]
    pub wait: Duration,
}

/// Flags of `outbox-relay demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Where the outbox lives (the demo uses its own schema by default).
    #[command(flatten)]
    pub db: DbArgs,
    /// AMQP URL [default: amqp://guest:***@127.0.0.1:5672/%2f].
    #[arg(
        long,
        env = "OUTBOX_AMQP_URL",
        hide_env_values = true,
        hide_default_value = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        value_parser = parse_amqp_url
    )]
    pub amqp_url: SecretUrl,
    /// Messages to commit.
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u16).range(1..=10_000))]
    pub count: u16,
}

/// Everything `run` needs, validated.
#[derive(Debug, Clone)]
pub struct Config {
    /// Postgres connection settings and TLS (Debug output hides the password).
    pub pg: crate::source::Database,
    /// The outbox schema.
    pub schema: SchemaName,
    /// The broker and how to reach it.
    pub broker: Broker,
    /// The relay loop's settings.
    pub settings: Settings,
    /// Where to serve metrics and health, if anywhere.
    pub http_addr: Option<std::net::SocketAddr>,
    /// CloudEvents binary mode, if on.
    pub cloudevents: Option<crate::publish::cloudevents::CloudEvents>,
}

/// A broker with its connection settings.
#[derive(Debug, Clone)]
pub enum Broker {
    /// RabbitMQ.
    Amqp(crate::publish::amqp::AmqpSettings),
    /// Kafka.
    Kafka(crate::publish::kafka::KafkaSettings),
}

impl RunArgs {
    /// Validates the flags into a [`Config`].
    pub fn into_config(self) -> Result<Config, ConfigError> {
        if self.hold_limit <= self.confirm_timeout {
            return Err(ConfigError {
                flag: "--hold-limit",
                reason: format!(
                    "{} must exceed --confirm-timeout ({}), or a slow broker would lose the rows' locks mid-batch",
                    humantime::format_duration(self.hold_limit),
                    humantime::format_duration(self.confirm_timeout)
                ),
            });
        }
        for (flag, pause) in [
            ("--poll-interval", self.poll_interval),
            ("--poll-min", self.poll_min),
        ] {
            if pause < Duration::from_millis(1) {
                return Err(ConfigError {
                    flag,
                    reason: format!(
                        "{} is under 1ms: an idle relay would claim in a busy loop",
                        humantime::format_duration(pause)
                    ),
                });
            }
        }
        let amqp_url = match &self.amqp_url_file {
            Some(path) => read_secret("--amqp-url-file", path, parse_amqp_url)?,
            None => self.amqp_url.clone(),
        };
        let ca_pem = match &self.amqp_ca_file {
            Some(path) => Some(read_ca_file("--amqp-ca-file", path)?),
            None => None,
        };
        // Validated whichever broker is chosen, so a typo never waits for the
        // day someone switches to Kafka.
        let mut kafka_properties: Vec<(String, String)> =
            split_kafka_properties(&self.kafka_config)
                .iter()
                .enumerate()
                .map(|(i, raw)| {
                    parse_kafka_property(raw)
                        .map(|p| (p.0, p.1))
                        .map_err(|reason| ConfigError {
                            flag: "--kafka-config",
                            reason: format!("entry {}: {reason}", i + 1),
                        })
                })
                .collect::<Result<_, _>>()?;
        if let Some(path) = &self.kafka_config_file {
            kafka_properties.extend(read_kafka_config_file(path)?);
        }
        let broker = match self.broker {
            BrokerKind::Amqp => Broker::Amqp(crate::publish::amqp::AmqpSettings {
                url: amqp_url.expose().to_owned(),
                confirm_timeout: self.confirm_timeout,
                connect_timeout: Duration::from_secs(10),
                ca_pem,
            }),
            BrokerKind::Kafka => Broker::Kafka(crate::publish::kafka::KafkaSettings {
                brokers: self.kafka_brokers.clone(),
                properties: kafka_properties,
                message_timeout: self.confirm_timeout,
            }),
        };
        let cloudevents = match (self.cloudevents, &self.cloudevents_source) {
            (true, Some(source)) => Some(
                crate::publish::cloudevents::CloudEvents::new(source.as_str()).map_err(
                    |reason| ConfigError {
                        flag: "--cloudevents-source",
                        reason,
                    },
                )?,
            ),
            _ => None,
        };
        Ok(Config {
            cloudevents,
            http_addr: self.http_addr.0,
            pg: self.db.database()?,
            schema: self.db.schema.clone(),
            broker,
            settings: Settings {
                batch_size: self.batch_size,
                batch_max_bytes: self.batch_max_bytes,
                pipeline: usize::from(self.pipeline),
                poll_interval: self.poll_interval,
                poll_min: self.poll_min.min(self.poll_interval),
                retry_base: self.retry_base,
                retry_max: self.retry_max,
                reconnect_max: self.reconnect_max,
                shutdown_grace: self.shutdown_grace,
                hold_limit: self.hold_limit,
                max_attempts: self.max_attempts,
                park_on_dead_letter: self.dead_letter_order == DeadLetterOrder::Park,
                lease: self.lease,
                retention: (!self.retention.is_zero()).then_some(self.retention),
                retention_cleanup_batch: self.retention_cleanup_batch,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn help_never_shows_the_default_password() {
        let mut cmd = Cli::command();
        let help = cmd
            .find_subcommand_mut("run")
            .map(|c| c.render_long_help().to_string())
            .unwrap_or_default();
        assert!(help.contains("--amqp-url"), "{help}");
        assert!(!help.contains("guest:guest"), "{help}");
    }

    #[test]
    fn bad_values_name_their_flag() {
        let err = Cli::try_parse_from(["outbox-relay", "run", "--poll-interval", "5"])
            .map(|_| ())
            .expect_err("a bare number is rejected");
        assert!(err.to_string().contains("--poll-interval"), "{err}");
        let err = Cli::try_parse_from(["outbox-relay", "run", "--schema", "Bad-Name"])
            .map(|_| ())
            .expect_err("bad schema is rejected");
        assert!(err.to_string().contains("--schema"), "{err}");
    }

    #[test]
    fn hold_limit_must_exceed_confirm_timeout() {
        let Ok(Cli {
            command: Command::Run(args),
            ..
        }) = Cli::try_parse_from([
            "outbox-relay",
            "run",
            "--confirm-timeout",
            "30s",
            "--hold-limit",
            "10s",
        ])
        else {
            panic!("flags parse");
        };
        let err = args.into_config().map(|_| ()).expect_err("rejected");
        assert_eq!(err.flag, "--hold-limit");
    }

    #[test]
    fn polling_pauses_under_a_millisecond_are_refused() {
        for (flag, value) in [("--poll-interval", "0s"), ("--poll-min", "100us")] {
            let Ok(Cli {
                command: Command::Run(args),
                ..
            }) = Cli::try_parse_from(["outbox-relay", "run", flag, value])
            else {
                panic!("flags parse");
            };
            let err = args.into_config().map(|_| ()).expect_err("rejected");
            assert_eq!(err.flag, flag);
            assert!(err.reason.contains("busy loop"), "{}", err.reason);
        }
        let Ok(Cli {
            command: Command::Run(args),
            ..
        }) = Cli::try_parse_from(["outbox-relay", "run", "--poll-interval", "2ms"])
        else {
            panic!("flags parse");
        };
        let config = args.into_config().expect("valid");
        assert_eq!(
            config.settings.poll_min,
            Duration::from_millis(2),
            "the shortest pause never exceeds the longest"
        );
    }
}

#[cfg(test)]
mod kafka_tests {
    use super::*;

    #[test]
    fn kafka_properties_parse_and_hide_secrets() {
        let Ok(Cli {
            command: Command::Run(args),
            ..
        }) = Cli::try_parse_from([
            "outbox-relay",
            "run",
            "--broker",
            "kafka",
            "--kafka-config",
            "compression.type=lz4",
            "--kafka-config",
            "sasl.password=hunter2",
        ])
        else {
            panic!("flags parse");
        };
        let config = args.into_config().expect("valid");
        let shown = format!("{config:?}");
        assert!(shown.contains("compression.type"), "{shown}");
        assert!(!shown.contains("hunter2"), "{shown}");
        let Ok(Cli {
            command: Command::Run(args),
            ..
        }) = Cli::try_parse_from([
            "outbox-relay",
            "run",
            "--kafka-config",
            "a=b",
            "--kafka-config",
            "sasl.password hunter2",
        ])
        else {
            panic!("flags parse");
        };
        let err = args.into_config().map(|_| ()).expect_err("rejected");
        assert_eq!(err.flag, "--kafka-config");
        assert!(err.to_string().contains("entry 2"), "{err}");
        assert!(!err.to_string().contains("hunter2"), "{err}");
    }

    #[test]
    fn a_comma_inside_a_value_stays_in_the_value() {
        let split = split_kafka_properties(&[
            "ssl.cipher.suites=ECDHE-RSA-AES128-GCM-SHA256,ECDHE-RSA-AES256-GCM-SHA384,linger.ms=5"
                .to_owned(),
            "compression.type=lz4\nclient.id=relay,".to_owned(),
        ]);
        assert_eq!(
            split,
            [
                "ssl.cipher.suites=ECDHE-RSA-AES128-GCM-SHA256,ECDHE-RSA-AES256-GCM-SHA384",
                "linger.ms=5",
                "compression.type=lz4",
                "client.id=relay",
            ]
        );
    }

    fn run_args(extra: &[&str]) -> RunArgs {
        let mut argv = vec!["outbox-relay", "run", "--broker", "kafka"];
        argv.extend_from_slice(extra);
        match Cli::try_parse_from(argv) {
            Ok(Cli {
                command: Command::Run(args),
                ..
            }) => *args,
            other => panic!("flags parse: {other:?}"),
        }
    }

    #[test]
    fn a_kafka_config_file_supplies_secrets_after_the_flags() {
        let dir = std::env::temp_dir().join(format!("kafka-config-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("kafka.properties");
        std::fs::write(
            &file,
            "# mounted secret\n\nsasl.username=relay\nsasl.password=s3cret-sentinel\n",
        )
        .expect("write");
        let path = file.to_str().expect("utf-8 path");
        let config = run_args(&[
            "--kafka-config",
            "sasl.mechanism=PLAIN",
            "--kafka-config-file",
            path,
        ])
        .into_config()
        .expect("valid");
        let Broker::Kafka(kafka) = &config.broker else {
            panic!("kafka broker");
        };
        let keys: Vec<&str> = kafka.properties.iter().map(|p| p.0.as_str()).collect();
        assert_eq!(keys, ["sasl.mechanism", "sasl.username", "sasl.password"]);
        assert!(!format!("{config:?}").contains("s3cret-sentinel"));

        std::fs::write(
            &file,
            "sasl.username=relay\nsasl.password s3cret-sentinel\n",
        )
        .expect("write");
        let err = run_args(&["--kafka-config-file", path])
            .into_config()
            .map(|_| ())
            .expect_err("line 2 has no =");
        assert_eq!(err.flag, "--kafka-config-file");
        assert!(err.reason.contains("line 2"), "{err}");
        assert!(!err.to_string().contains("s3cret-sentinel"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn database_flags_work_after_a_nested_subcommand() {
        let cli = Cli::try_parse_from([
            "outbox-relay",
            "dead-letters",
            "list",
            "--database-url",
            "postgres://u@db.example:5433/app",
            "--schema",
            "orders_outbox",
        ])
        .expect("flags after the subcommand parse");
        let Command::DeadLetters { db, .. } = cli.command else {
            panic!("dead-letters");
        };
        assert_eq!(db.schema.as_str(), "orders_outbox");
        assert!(db.database_url.expose().contains("db.example:5433"));
    }

    #[test]
    fn properties_that_would_weaken_delivery_are_refused() {
        assert!(parse_kafka_property("acks=all").is_ok());
        assert!(parse_kafka_property("acks=-1").is_ok());
        assert!(parse_kafka_property("enable.idempotence=true").is_ok());
        let acks = parse_kafka_property("acks=1")
            .map(|_| ())
            .expect_err("acks=1");
        assert!(acks.contains("acks=all"), "{acks}");
        let idem = parse_kafka_property(" enable.idempotence = false")
            .map(|_| ())
            .expect_err("idempotence off");
        assert!(idem.contains("enable.idempotence"), "{idem}");
    }
}
