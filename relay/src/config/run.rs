//! `outbox-relay run`: its flags and their validation into a [`Config`].

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use outbox_client::SchemaName;

use super::kafka::{parse_kafka_property, read_kafka_config_file, split_kafka_properties};
use super::values::{parse_bytes, parse_duration, parse_http_addr, read_ca_file};
use super::{ConfigError, DbArgs, HttpAddr};
use crate::engine::Settings;

/// The broker to publish to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BrokerKind {
    /// RabbitMQ, or any AMQP 0-9-1 broker with publisher confirms.
    Amqp,
    /// Kafka, or any Kafka-protocol broker.
    Kafka,
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
    /// Where RabbitMQ is.
    #[command(flatten)]
    pub amqp: super::AmqpArgs,
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
    /// limit (the defaults, 4 x 8 MiB, fit a 256 MiB limit with room). On
    /// Kafka, librdkafka's local queue is sized to twice what the batches in
    /// flight may hold (64 MiB at least). Header bytes count with payloads.
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
    /// Each batch has a fixed cost (round trips, wake-ups), so a longer pause
    /// means less CPU per message and a little more latency: at 1,000 msg/s,
    /// 10ms gave batches of about 11 and p99 15 ms on RabbitMQ, 5ms batches
    /// of 7, p99 10 ms and a third more CPU. A stream fast enough to bring
    /// about 32 rows sooner (at 10ms, above about 3,000 msg/s) is claimed
    /// then, without waiting out the rest of the pause.
    #[arg(long, env = "OUTBOX_POLL_MIN", default_value = "10ms", value_parser = parse_duration)]
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
    /// Longest a sent batch waits while the broker confirms nothing at all;
    /// past it the connection is presumed dead, reopened, and what was not
    /// confirmed sent again. A broker still confirming is waited for up to
    /// a little before half --hold-limit. On Kafka this is
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
    /// At least 1s: the server ends an ownership session silent for this
    /// long, and a shorter one ends at any pause of the process.
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
    /// How often the claim floor is recomputed from the start of the fresh
    /// index. The floor is a seq below which no unpublished row can exist or
    /// appear, so claims skip rows deleted while an old snapshot elsewhere
    /// (a report, pg_dump) keeps them from being cleaned up; a rescan brings
    /// back a row that something other than the relay (a hand-written UPDATE,
    /// an older relay's `dead-letters retry`) put below it. "0s" turns the
    /// floor off: every claim scans from the start.
    #[arg(long, env = "OUTBOX_CLAIM_FLOOR_RESCAN", default_value = "60s", value_parser = parse_duration)]
    pub claim_floor_rescan: Duration,
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

impl DeadLetterOrder {
    /// Whether a dead letter holds its key's later messages back.
    pub fn parks(self) -> bool {
        self == DeadLetterOrder::Park
    }
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

/// The shortest `--lease`.
const MIN_LEASE: Duration = Duration::from_secs(1);

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
        if self.lease < MIN_LEASE {
            return Err(ConfigError {
                flag: "--lease",
                reason: format!(
                    "{} is under {}: Postgres ends an ownership session silent for the lease, \
                     and one this short ends at any pause of the process (a CPU-throttled \
                     container, a garbage-collected neighbour), so partitions and readiness \
                     would come and go",
                    humantime::format_duration(self.lease),
                    humantime::format_duration(MIN_LEASE)
                ),
            });
        }
        for (flag, wait, what) in [
            (
                "--confirm-timeout",
                self.confirm_timeout,
                "every broker set-up and batch would time out at once (and librdkafka reads 0 as no timeout)",
            ),
            (
                "--retry-base",
                self.retry_base,
                "a rejected message would be sent again at once, in a loop",
            ),
            (
                "--retry-max",
                self.retry_max,
                "a rejected message would be sent again at once, in a loop",
            ),
            (
                "--reconnect-max",
                self.reconnect_max,
                "an outage would be met by reconnecting in a busy loop",
            ),
        ] {
            if wait < Duration::from_millis(1) {
                return Err(ConfigError {
                    flag,
                    reason: format!("{} is under 1ms: {what}", humantime::format_duration(wait)),
                });
            }
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
        let amqp_url = self.amqp.url()?;
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
            BrokerKind::Kafka => {
                let kafka = crate::publish::kafka::KafkaSettings {
                    brokers: self.kafka_brokers.clone(),
                    properties: kafka_properties,
                    message_timeout: self.confirm_timeout,
                    in_flight: crate::publish::kafka::InFlight {
                        pipeline: usize::from(self.pipeline),
                        batch_size: usize::try_from(self.batch_size).unwrap_or(usize::MAX),
                        batch_bytes: usize::try_from(self.batch_max_bytes).unwrap_or(usize::MAX),
                    },
                };
                kafka.check_queue().map_err(|e| ConfigError {
                    flag: "--kafka-config",
                    reason: e.to_string(),
                })?;
                // message.timeout.ms passed through replaces
                // --confirm-timeout, and must keep within the hold limit
                // as it would.
                let timeout = kafka.clone().with_passed_through_timeout().message_timeout;
                if timeout.is_zero() || self.hold_limit <= timeout {
                    return Err(ConfigError {
                        flag: "--kafka-config",
                        reason: format!(
                            "message.timeout.ms (or delivery.timeout.ms) of {} {}: librdkafka would \
                             keep sending records whose rows the relay has released and sends again; \
                             lower it or raise --hold-limit",
                            humantime::format_duration(timeout),
                            if timeout.is_zero() {
                                "is no timeout at all".to_owned()
                            } else {
                                format!(
                                    "is not under --hold-limit ({})",
                                    humantime::format_duration(self.hold_limit)
                                )
                            }
                        ),
                    });
                }
                Broker::Kafka(kafka)
            }
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
                park_on_dead_letter: self.dead_letter_order.parks(),
                lease: self.lease,
                retention: (!self.retention.is_zero()).then_some(self.retention),
                retention_cleanup_batch: self.retention_cleanup_batch,
                claim_floor_rescan: (!self.claim_floor_rescan.is_zero())
                    .then_some(self.claim_floor_rescan),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Cli, Command};
    use clap::CommandFactory;
    use clap::Parser;

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
    fn one_runtime_thread_unless_asked() {
        let cli = Cli::try_parse_from(["outbox-relay", "run"]).expect("defaults parse");
        assert_eq!(cli.runtime_threads, 1);
        // Global: before or after the subcommand.
        for argv in [
            ["outbox-relay", "--runtime-threads", "4", "run"],
            ["outbox-relay", "run", "--runtime-threads", "4"],
        ] {
            let cli = Cli::try_parse_from(argv).expect("parses");
            assert_eq!(cli.runtime_threads, 4, "{argv:?}");
        }
        let err = Cli::try_parse_from(["outbox-relay", "run", "--runtime-threads", "0"])
            .map(|_| ())
            .expect_err("a runtime needs a thread");
        assert!(err.to_string().contains("--runtime-threads"), "{err}");
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

    /// A lease of 0 or under a second was taken as it came: the ownership
    /// session's idle timeout then ended it at any pause of the process
    /// (0 turned the server's timeout off, and the heartbeat spun).
    #[test]
    fn a_lease_under_a_second_is_refused() {
        for lease in ["0s", "200ms"] {
            let err = config_of(&["outbox-relay", "run", "--lease", lease])
                .map(|_| ())
                .expect_err("refused");
            assert_eq!(err.flag, "--lease", "{err}");
        }
        config_of(&["outbox-relay", "run", "--lease", "1s"]).expect("a lease of 1s");
    }

    fn config_of(argv: &[&str]) -> Result<Config, ConfigError> {
        let Ok(Cli {
            command: Command::Run(args),
            ..
        }) = Cli::try_parse_from(argv)
        else {
            panic!("flags parse: {argv:?}");
        };
        args.into_config()
    }

    /// clap's message for a value its parser refuses quotes the value: a
    /// URL with a typo elsewhere put its password on the terminal and in
    /// the logs.
    #[test]
    fn a_url_refused_at_parsing_never_shows_its_password() {
        for (flag, url) in [
            (
                "--database-url",
                "postgres://relay:S3cret-pw@db/app?sslmode=verify-fulll",
            ),
            ("--amqp-url", "amqp:relay:S3cret-pw@rabbit"),
            ("--amqp-url", "amqps://relay:S3cret-pw@rabbit:notaport/%2f"),
        ] {
            let err = Cli::try_parse_from(["outbox-relay", "run", flag, url])
                .map(|_| ())
                .expect_err(url);
            let shown = err.to_string();
            assert!(!shown.contains("S3cret-pw"), "{shown}");
            assert!(shown.contains(flag), "{shown}");
        }
    }

    #[test]
    fn zero_waits_that_would_loop_or_time_out_at_once_are_refused() {
        for flag in [
            "--confirm-timeout",
            "--retry-base",
            "--retry-max",
            "--reconnect-max",
        ] {
            let err = config_of(&["outbox-relay", "run", flag, "0s"])
                .map(|_| ())
                .expect_err(flag);
            assert_eq!(err.flag, flag);
            assert!(err.reason.contains("under 1ms"), "{}", err.reason);
        }
        assert!(config_of(&["outbox-relay", "run", "--reconnect-max", "1ms"]).is_ok());
    }

    /// A Kafka timeout passed through (the Java client's
    /// delivery.timeout.ms of 120 s is often copied) replaces
    /// --confirm-timeout, so the hold limit must exceed it as it would.
    #[test]
    fn a_passed_through_kafka_timeout_must_keep_within_the_hold_limit() {
        for timeout in ["delivery.timeout.ms=120000", "message.timeout.ms=0"] {
            let err = config_of(&[
                "outbox-relay",
                "run",
                "--broker",
                "kafka",
                "--kafka-config",
                timeout,
            ])
            .map(|_| ())
            .expect_err(timeout);
            assert_eq!(err.flag, "--kafka-config", "{timeout}");
            assert!(err.reason.contains("--hold-limit"), "{}", err.reason);
        }
        assert!(config_of(&[
            "outbox-relay",
            "run",
            "--broker",
            "kafka",
            "--kafka-config",
            "delivery.timeout.ms=120000",
            "--hold-limit",
            "5m",
        ])
        .is_ok());
    }

    #[test]
    fn a_kafka_queue_too_small_for_one_record_is_refused_at_start_up() {
        let err = config_of(&[
            "outbox-relay",
            "run",
            "--broker",
            "kafka",
            "--kafka-config",
            "message.max.bytes=100000000,queue.buffering.max.kbytes=65536",
        ])
        .map(|_| ())
        .expect_err("rejected");
        assert_eq!(err.flag, "--kafka-config");
        assert!(
            err.reason.contains("queue.buffering.max.kbytes=65536"),
            "{}",
            err.reason
        );
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
