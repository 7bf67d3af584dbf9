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
    /// What the relay may hand to librdkafka at once; its local queue is
    /// sized to hold it (see [`InFlight`]).
    pub in_flight: InFlight,
}

/// The most the relay hands to librdkafka at once: `pipeline` batches, each
/// of at most `batch_size` records and `batch_bytes` of payload (or one
/// larger record alone). librdkafka refuses a record its local queue has no
/// room for (QUEUE_FULL), and the relay takes that as an outage and sends the
/// batch again; so the queue must hold the whole window, and any one record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InFlight {
    /// `--pipeline`.
    pub pipeline: usize,
    /// `--batch-size`.
    pub batch_size: usize,
    /// `--batch-max-bytes`.
    pub batch_bytes: usize,
}

impl Default for InFlight {
    /// The relay's own defaults: 3 batches of 500 records and 8 MiB.
    fn default() -> Self {
        InFlight {
            pipeline: 3,
            batch_size: 500,
            batch_bytes: 8 << 20,
        }
    }
}

/// librdkafka's local queue, as the relay sizes it unless told otherwise: at
/// least this many records...
const QUEUE_RECORDS: usize = 100_000;
/// ...and KiB. librdkafka's own default is 1 GiB; a relay never needs more
/// than its batches in flight, and the backlog belongs in Postgres.
const QUEUE_KIB: usize = 64 << 10;
/// The largest either property takes.
const QUEUE_MAX: usize = i32::MAX as usize;

/// `queue.buffering.max.kbytes` passed through, too small for the largest
/// record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{property}={value} is too small: {needed}; raise it (--kafka-config) or lower {flags}")]
pub struct QueueTooSmall {
    /// The property.
    pub property: &'static str,
    /// Its value as librdkafka reads it.
    pub value: usize,
    /// What it must hold, and why.
    pub needed: String,
    /// The relay's flags that set what it must hold.
    pub flags: &'static str,
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
        // librdkafka's local queue, unless passed through: room for the
        // window twice over (a batch given up at its deadline keeps its
        // records there until their timeout, beside the batches after it),
        // never less than librdkafka's usual 100,000 records nor more than
        // it takes, and no more bytes than that needs: the backlog belongs
        // in Postgres.
        if !self.passed("queue.buffering.max.messages") {
            let records = self
                .in_flight
                .records()
                .saturating_mul(2)
                .clamp(QUEUE_RECORDS, QUEUE_MAX);
            c.set("queue.buffering.max.messages", records.to_string());
        }
        if !self.passed("queue.buffering.max.kbytes") {
            let bytes = (self.in_flight.bytes(native(&c, "message.max.bytes"))).saturating_mul(2);
            let kib = bytes.div_ceil(1024).clamp(QUEUE_KIB, QUEUE_MAX);
            c.set("queue.buffering.max.kbytes", kib.to_string());
        }
        c
    }

    /// Whether `property` is among those passed through.
    fn passed(&self, property: &str) -> bool {
        self.properties.iter().any(|(k, _)| k.trim() == property)
    }

    /// Refuses a local queue passed through that cannot hold the largest
    /// record the relay may send (`message.max.bytes`): librdkafka would
    /// refuse it QUEUE_FULL however long it waited, and it would stall its
    /// key for good. A queue smaller than the window only makes batches wait
    /// for room (see `KafkaPublisher::publish_until`).
    pub fn check_queue(&self) -> Result<(), QueueTooSmall> {
        let c = self.client_config();
        let (Some(largest), Some(kib)) = (
            native(&c, "message.max.bytes"),
            native(&c, "queue.buffering.max.kbytes"),
        ) else {
            return Ok(());
        };
        if kib.saturating_mul(1024) < largest {
            return Err(QueueTooSmall {
                property: "queue.buffering.max.kbytes",
                value: kib,
                needed: format!(
                    "it must hold the largest record the relay sends, message.max.bytes ({largest} \
                     bytes), or a record that size would wait for room for good"
                ),
                flags: "message.max.bytes",
            });
        }
        Ok(())
    }
}

impl InFlight {
    /// Records at once.
    fn records(&self) -> usize {
        self.pipeline.saturating_mul(self.batch_size)
    }

    /// Payload bytes at once, with records of up to `largest` bytes.
    fn bytes(&self, largest: Option<usize>) -> usize {
        self.pipeline
            .saturating_mul(self.batch_bytes.max(largest.unwrap_or(0)))
    }
}

/// `property` as librdkafka reads it from `config` (hex, suffixes, its
/// default when unset); none if it cannot say.
pub(super) fn native(config: &ClientConfig, property: &str) -> Option<usize> {
    config
        .create_native_config()
        .ok()
        .and_then(|n| n.get(property).ok())
        .and_then(|v| v.parse().ok())
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
            in_flight: InFlight::default(),
        }
        .with_passed_through_timeout()
    }

    fn window(pipeline: usize, batch_size: usize, batch_bytes: usize) -> InFlight {
        InFlight {
            pipeline,
            batch_size,
            batch_bytes,
        }
    }

    /// The queue as librdkafka reads it: records and KiB.
    fn queue(s: &KafkaSettings) -> (Option<usize>, Option<usize>) {
        let c = s.client_config();
        (
            native(&c, "queue.buffering.max.messages"),
            native(&c, "queue.buffering.max.kbytes"),
        )
    }

    #[test]
    fn the_local_queue_holds_whatever_window_the_flags_allow() {
        // The defaults: librdkafka's usual 100,000 records, 64 MiB.
        assert_eq!(queue(&with(&[])), (Some(100_000), Some(65_536)));
        assert_eq!(with(&[]).check_queue(), Ok(()));
        // The largest window the flags take: 32 batches of 10,000 records
        // and 8 MiB, which the fixed 100,000 records and 64 MiB refused.
        let mut widest = with(&[]);
        widest.in_flight = window(32, 10_000, 8 << 20);
        let (records, kib) = queue(&widest);
        assert!(records.is_some_and(|r| r >= 320_000), "{records:?}");
        assert!(kib.is_some_and(|k| k >= (32 * 8) << 10), "{kib:?}");
        assert_eq!(widest.check_queue(), Ok(()));
        // A record as large as message.max.bytes goes alone, above
        // --batch-max-bytes: the queue takes pipeline of them.
        let mut large = with(&[("message.max.bytes", "100000000")]);
        large.in_flight = window(3, 500, 1 << 20);
        let (_, kib) = queue(&large);
        assert!(kib.is_some_and(|k| k * 1024 >= 300_000_000), "{kib:?}");
        assert_eq!(large.check_queue(), Ok(()));
    }

    #[test]
    fn a_queue_passed_through_too_small_for_one_record_is_refused_naming_it() {
        // Smaller than the window: batches wait for room, nothing refused.
        let small = with(&[("queue.buffering.max.messages", "100")]);
        assert_eq!(queue(&small).0, Some(100), "passed through as given");
        assert_eq!(small.check_queue(), Ok(()));
        // One record larger than the whole queue could never be queued.
        let err = with(&[
            ("message.max.bytes", "100000000"),
            ("queue.buffering.max.kbytes", "65536"),
        ])
        .check_queue()
        .expect_err("100 MB records in a 64 MiB queue");
        assert_eq!(err.property, "queue.buffering.max.kbytes");
        assert_eq!(err.value, 65_536);
        assert!(err.to_string().contains("100000000"), "{err}");
        assert_eq!(
            with(&[
                ("message.max.bytes", "100000000"),
                ("queue.buffering.max.kbytes", "97657"),
            ])
            .check_queue(),
            Ok(()),
            "97,657 KiB hold 100,000,000 bytes"
        );
    }
}
