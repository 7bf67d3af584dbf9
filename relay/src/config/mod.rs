//! Command line and environment, validated once into a [`Config`].
//!
//! Every flag has an `OUTBOX_...` environment variable. Secrets (the database and
//! broker URLs) can also come from a file named by the `..._FILE` variant, and
//! are never echoed: `--help` hides their values and logs redact them.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use outbox_client::SchemaName;

mod kafka;
mod run;
mod values;

pub use kafka::{kafka_client_error, KafkaProperty};
pub use run::{Broker, BrokerKind, Config, DeadLetterOrder, RunArgs};
use values::{
    parse_amqp_url, parse_duration, parse_http_addr, parse_pg_url, parse_schema, read_secret,
    SecretUrlParser,
};
pub use values::{HttpAddr, SecretUrl};

/// Relays committed outbox rows to a broker, at least once, each stamped with a
/// stable message id.
#[derive(Debug, Parser)]
#[command(name = "outbox-relay", version, about, propagate_version = true)]
pub struct Cli {
    /// Log format.
    #[arg(long, env = "OUTBOX_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
    /// Threads of the relay's async runtime. The relay mostly waits on
    /// Postgres and the broker, and Kafka's client and the AMQP connection
    /// each run on threads of their own, so one is the default: at 1,000
    /// msg/s a second thread cost a tenth more CPU per message, spent on
    /// waking threads, and no drain measured faster with it
    /// (docs/benchmarks.md, "One runtime thread"). Raise it when the relay
    /// process's own CPU, as its container or `top` shows it, nears one core.
    #[arg(
        long,
        env = "OUTBOX_RUNTIME_THREADS",
        default_value_t = 1,
        value_parser = clap::value_parser!(u16).range(1..=1024),
        global = true
    )]
    pub runtime_threads: u16,
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
        /// How the relay treats a dead letter's later messages.
        #[command(flatten)]
        order: OrderArgs,
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
        /// How the relay treats a dead letter's later messages.
        #[command(flatten)]
        order: OrderArgs,
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

/// `--dead-letter-order` as `run` was given it, for the commands that report
/// parked keys.
#[derive(Debug, Clone, Args)]
pub struct OrderArgs {
    /// As given to `run`: under `skip` a dead letter's later messages go
    /// ahead, and no key is parked.
    #[arg(long, env = "OUTBOX_DEAD_LETTER_ORDER", value_enum, default_value_t = DeadLetterOrder::Park)]
    pub dead_letter_order: DeadLetterOrder,
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

/// An RFC 3339 time in UTC. One without a zone is refused: read as UTC, an
/// operator's local time would select hours more (or fewer) dead letters
/// than meant, for `discard` to delete.
fn parse_time(s: &str) -> Result<std::time::SystemTime, String> {
    if !s.trim_end().ends_with(['Z', 'z']) {
        return Err(format!(
            "{s:?} has no time zone: give the time in UTC with a Z, e.g. 2026-11-29T10:00:00Z"
        ));
    }
    humantime::parse_rfc3339_weak(s)
        .map_err(|e| format!("{e} (use RFC 3339 in UTC, e.g. 2026-11-29T10:00:00Z)"))
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
        value_parser = SecretUrlParser(parse_pg_url),
        global = true
    )]
    pub database_url: SecretUrl,
    /// Read the Postgres URL from this file instead (e.g. a mounted secret).
    /// Refused beside --database-url (or OUTBOX_DATABASE_URL): the two would
    /// name two databases, and one would win without a word.
    #[arg(
        long,
        env = "OUTBOX_DATABASE_URL_FILE",
        global = true,
        conflicts_with = "database_url"
    )]
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

/// Where RabbitMQ is, for `run` and `demo`.
#[derive(Debug, Clone, Args)]
pub struct AmqpArgs {
    /// AMQP URL [default: amqp://guest:***@127.0.0.1:5672/%2f, RabbitMQ's local guest account].
    #[arg(
        long,
        env = "OUTBOX_AMQP_URL",
        hide_env_values = true,
        hide_default_value = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        value_parser = SecretUrlParser(parse_amqp_url)
    )]
    pub amqp_url: SecretUrl,
    /// Read the AMQP URL from this file instead. Refused beside --amqp-url
    /// (or OUTBOX_AMQP_URL).
    #[arg(long, env = "OUTBOX_AMQP_URL_FILE", conflicts_with = "amqp_url")]
    pub amqp_url_file: Option<PathBuf>,
}

impl AmqpArgs {
    /// The AMQP URL, with the `_FILE` variant applied.
    pub fn url(&self) -> Result<SecretUrl, ConfigError> {
        match &self.amqp_url_file {
            Some(path) => read_secret("--amqp-url-file", path, parse_amqp_url),
            None => Ok(self.amqp_url.clone()),
        }
    }
}

/// Flags of `outbox-relay demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Where the outbox lives: the demo migrates that schema, adds a
    /// `demo_orders` table to it and relays every message in it, so point
    /// it (--schema) at a schema of its own, never a live outbox's.
    #[command(flatten)]
    pub db: DbArgs,
    /// Where RabbitMQ is.
    #[command(flatten)]
    pub amqp: AmqpArgs,
    /// Messages to commit.
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u16).range(1..=10_000))]
    pub count: u16,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_since_without_a_time_zone_is_refused_not_read_as_utc() {
        let err = parse_time("2026-11-29 10:00:00").expect_err("no zone");
        assert!(err.contains("no time zone"), "{err}");
        let err = parse_time("2026-11-29T10:00:00+02:00").expect_err("an offset");
        assert!(err.contains("no time zone"), "{err}");
        assert_eq!(
            parse_time("2026-11-29T10:00:00Z"),
            humantime::parse_rfc3339("2026-11-29T10:00:00Z").map_err(|e| e.to_string())
        );
        assert!(parse_time("2026-11-29 10:00:00Z").is_ok());
    }
}
