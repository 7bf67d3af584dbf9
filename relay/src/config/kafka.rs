//! librdkafka pass-through properties: parsing, splitting, the properties
//! file, and the two the relay's guarantees rest on.

use std::fmt;
use std::path::PathBuf;

use super::ConfigError;

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

/// Why librdkafka refused the producer's configuration, without the
/// property's value: rdkafka's own message ends with it, and it may be a
/// secret (a misspelt `sasl.password`, which no name check marks secret).
pub fn kafka_client_error(e: rdkafka::error::KafkaError) -> String {
    match e {
        rdkafka::error::KafkaError::ClientConfig(_, description, key, _) => {
            format!("{description} (property {key:?}; value not shown)")
        }
        e => e.to_string(),
    }
}

pub(super) fn parse_kafka_property(s: &str) -> Result<KafkaProperty, String> {
    match s.split_once('=') {
        // The relay's guarantees rest on these; they are not negotiable.
        Some((k, v)) if k.trim() == "acks" && !matches!(v.trim(), "all" | "-1") => Err(format!(
            "acks={} lets the broker confirm records it can still lose; the relay needs acks=all",
            v.trim()
        )),
        Some((k, v)) if k.trim() == "enable.idempotence" && v.trim() != "true" => Err(
            "enable.idempotence must stay true: without it librdkafka's retries can reorder or \
             duplicate records within a partition"
                .to_owned(),
        ),
        Some((k, v)) if k.trim() == "enable.gapless.guarantee" && v.trim() != "true" => Err(
            "enable.gapless.guarantee must stay true: without it a record the broker refuses \
             lets its key's later records go ahead of it"
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
pub(super) fn split_kafka_properties(values: &[String]) -> Vec<String> {
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
pub(super) fn read_kafka_config_file(path: &PathBuf) -> Result<Vec<(String, String)>, ConfigError> {
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

#[cfg(test)]
mod kafka_tests {
    use super::*;
    use crate::config::{Broker, Cli, Command, RunArgs};
    use clap::Parser;

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
    fn a_property_librdkafka_refuses_is_named_without_its_value() {
        let refused =
            crate::publish::kafka::KafkaPublisher::new(crate::publish::kafka::KafkaSettings {
                brokers: "127.0.0.1:9092".into(),
                properties: vec![("sasl.pasword".into(), "S3cret-value".into())],
                message_timeout: std::time::Duration::from_secs(30),
                in_flight: Default::default(),
            })
            .map(|_| ())
            .expect_err("a misspelt property");
        assert!(
            refused.to_string().contains("S3cret-value"),
            "rdkafka's own message quotes the value: {refused}"
        );
        let shown = kafka_client_error(refused);
        assert!(!shown.contains("S3cret-value"), "{shown}");
        assert!(shown.contains("sasl.pasword"), "{shown}");
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
        assert!(parse_kafka_property("enable.gapless.guarantee=true").is_ok());
        let gaps = parse_kafka_property("enable.gapless.guarantee=false")
            .map(|_| ())
            .expect_err("gaps allowed");
        assert!(gaps.contains("enable.gapless.guarantee"), "{gaps}");
    }
}
