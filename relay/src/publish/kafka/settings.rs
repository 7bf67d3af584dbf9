//! What the relay asks of librdkafka, and which of its properties are secret.

use std::time::Duration;

use rdkafka::config::ClientConfig;

/// Settings for [`super::KafkaPublisher`].
#[derive(Clone)]
pub struct KafkaSettings {
    /// `bootstrap.servers`.
    pub brokers: String,
    /// librdkafka properties passed through verbatim; they override the
    /// relay's defaults (SASL, TLS, compression, linger, ...).
    pub properties: Vec<(String, String)>,
    /// `message.timeout.ms`: how long librdkafka keeps retrying a record before
    /// reporting it failed. The batch is then retried by the relay.
    pub message_timeout: Duration,
}

/// Property names whose values are secrets.
pub fn is_secret(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    [
        "password",
        "secret",
        "sasl.oauthbearer.config",
        "ssl.key.pem",
    ]
    .iter()
    .any(|s| k.contains(s))
}

impl std::fmt::Debug for KafkaSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let props: Vec<(&str, &str)> = self
            .properties
            .iter()
            .map(|(k, v)| (k.as_str(), if is_secret(k) { "***" } else { v.as_str() }))
            .collect();
        f.debug_struct("KafkaSettings")
            .field("brokers", &self.brokers)
            .field("properties", &props)
            .field("message_timeout", &self.message_timeout)
            .finish()
    }
}

impl KafkaSettings {
    /// These settings with `message_timeout` as librdkafka will have it: a
    /// `message.timeout.ms` (or its alias `delivery.timeout.ms`) passed
    /// through overrides `--confirm-timeout`, and the relay's own waits
    /// (silent partitions, pacing, a batch's deadline) must count the same.
    pub fn with_passed_through_timeout(mut self) -> Self {
        let passed = self
            .properties
            .iter()
            .rev()
            .find(|(k, _)| k == "message.timeout.ms" || k == "delivery.timeout.ms")
            .and_then(|(_, v)| v.trim().parse::<u64>().ok());
        if let Some(ms) = passed {
            self.message_timeout = Duration::from_millis(ms);
        }
        self
    }

    /// The producer configuration: safe defaults first, pass-through last.
    pub fn client_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers)
            .set("enable.idempotence", "true")
            // A record the broker refuses for good (an old epoch, a record
            // too large for the topic) would otherwise leave a gap: the
            // producer bumps its epoch and sends the key's later records,
            // which land ahead of the refused one when it is sent again.
            // With this the producer stops at the refusal instead, the
            // later records fail unsent, and the relay builds a new
            // producer (`recover_if_stuck`).
            .set("enable.gapless.guarantee", "true")
            .set("acks", "all")
            // Same partition for a key as the Java client gives it, so consumers
            // and other producers agree on where a key lives.
            .set("partitioner", "murmur2_random")
            .set(
                "message.timeout.ms",
                self.message_timeout.as_millis().to_string(),
            )
            // librdkafka's default local queue is 1 GiB; a relay never needs more
            // than its batches in flight, and the backlog belongs in Postgres.
            .set("queue.buffering.max.kbytes", "65536")
            .set("queue.buffering.max.messages", "100000")
            // A claimed batch is produced all at once, so a longer linger
            // only delays it: 5 ms (librdkafka's default) added 4-6 ms to
            // p99 at 1,000 msg/s, and a backlog drain was no faster for it.
            .set("linger.ms", "1")
            // The idempotence state in them tells when a producer has its
            // id (see `super::setup`).
            .set(
                "statistics.interval.ms",
                super::setup::STATISTICS_INTERVAL.as_millis().to_string(),
            );
        for (k, v) in &self.properties {
            c.set(k, v);
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(properties: &[(&str, &str)]) -> KafkaSettings {
        KafkaSettings {
            brokers: "127.0.0.1:9092".into(),
            properties: properties
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            message_timeout: Duration::from_secs(30),
        }
        .with_passed_through_timeout()
    }

    #[test]
    fn a_passed_through_message_timeout_is_the_one_the_relay_counts() {
        assert_eq!(with(&[]).message_timeout, Duration::from_secs(30));
        let s = with(&[("message.timeout.ms", "1500")]);
        assert_eq!(s.message_timeout, Duration::from_millis(1500));
        assert_eq!(
            s.client_config().get("message.timeout.ms"),
            Some("1500"),
            "and librdkafka's"
        );
        let alias = with(&[
            ("message.timeout.ms", "1500"),
            ("delivery.timeout.ms", "9000"),
        ]);
        assert_eq!(
            alias.message_timeout,
            Duration::from_millis(9000),
            "last wins"
        );
        let unparsed = with(&[("message.timeout.ms", "soon")]);
        assert_eq!(unparsed.message_timeout, Duration::from_secs(30));
    }
}
