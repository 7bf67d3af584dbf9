//! Kafka through librdkafka's idempotent producer.
//!
//! `enable.idempotence=true` with `acks=all` makes librdkafka retry internally
//! without duplicating or reordering records within a partition, so a record's
//! delivery report is the broker's durable "yes". The ordering key is the record
//! key (so one key lands in one partition, in order); the message id travels in
//! the `message-id` header.
//!
//! Errors that can never succeed for a record (too large, invalid) are rejected
//! per message and recorded on the row. Every other error, including a timed
//! out record whose status is "possibly persisted", fails the whole batch: it is
//! retried, and a record that did reach the broker becomes a duplicate with the
//! same message id, never a loss. So is a record librdkafka reports delivered
//! without an offset: it inferred that, the broker never said it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::channel::oneshot;
use futures::future::join_all;
use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Message, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer, ProducerContext};

use super::cloudevents::CloudEvents;
use super::{Envelope, PublishError, Publisher, Receipt, Rejection, Verdict};

/// Settings for [`KafkaPublisher`].
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
    /// The producer configuration: safe defaults first, pass-through last.
    pub fn client_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers)
            .set("enable.idempotence", "true")
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
            .set("linger.ms", "5");
        for (k, v) in &self.properties {
            c.set(k, v);
        }
        c
    }
}

/// A record's delivery report: its partition and offset, or why it failed.
type Report = Result<(i32, i64), KafkaError>;

/// Hands each delivery report to the future waiting for it.
struct Deliveries;

impl ClientContext for Deliveries {}

impl ProducerContext for Deliveries {
    type DeliveryOpaque = Box<oneshot::Sender<Report>>;

    fn delivery(&self, result: &DeliveryResult<'_>, waiting: Self::DeliveryOpaque) {
        let report = match result {
            Ok(m) => Ok((m.partition(), m.offset())),
            Err((e, _)) => Err(e.clone()),
        };
        // The batch may have given up waiting; nothing else to tell.
        let _ = waiting.send(report);
    }
}

/// librdkafka's producer with a thread of its own serving delivery reports.
///
/// rdkafka's `FutureProducer` polls every 100 ms and rounds the rest of each
/// wait down to whole milliseconds, so the last part of every poll spins:
/// an idle relay spent 0.8 % of a core in that thread. This one waits up to
/// a second per poll (a report still wakes it at once), so the spin is a
/// tenth of that. Dropping it does not wait: the thread notices within a
/// second and destroys the producer itself.
struct KafkaProducer {
    inner: Arc<BaseProducer<Deliveries>>,
    stop: Arc<AtomicBool>,
}

impl KafkaProducer {
    fn new(config: &ClientConfig) -> Result<Self, KafkaError> {
        let inner: Arc<BaseProducer<Deliveries>> =
            Arc::new(config.create_with_context(Deliveries)?);
        let stop = Arc::new(AtomicBool::new(false));
        let (producer, stopped) = (Arc::clone(&inner), Arc::clone(&stop));
        std::thread::Builder::new()
            .name("kafka-reports".into())
            .spawn(move || {
                while !stopped.load(Ordering::Relaxed) {
                    producer.poll(Duration::from_secs(1));
                }
            })
            .map_err(|e| KafkaError::ClientCreation(format!("delivery report thread: {e}")))?;
        Ok(KafkaProducer { inner, stop })
    }
}

impl Drop for KafkaProducer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Publishes to Kafka; rebuilds the producer if librdkafka reports it fatally
/// failed (an idempotence violation it cannot repair).
pub struct KafkaPublisher {
    settings: KafkaSettings,
    producer: RwLock<Arc<KafkaProducer>>,
    /// CloudEvents binary mode, when on: `ce_` headers on every record.
    cloudevents: Option<CloudEvents>,
}

impl std::fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaPublisher")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl KafkaPublisher {
    /// Creates the producer; fails on an invalid property.
    pub fn new(settings: KafkaSettings) -> Result<Self, KafkaError> {
        let producer = KafkaProducer::new(&settings.client_config())?;
        Ok(KafkaPublisher {
            settings,
            producer: RwLock::new(Arc::new(producer)),
            cloudevents: None,
        })
    }

    /// Publishes every record as a CloudEvent in binary content mode, with
    /// the Kafka binding's `ce_` headers ([`super::cloudevents`]).
    pub fn with_cloudevents(mut self, cloudevents: CloudEvents) -> Self {
        self.cloudevents = Some(cloudevents);
        self
    }

    fn producer(&self) -> Arc<KafkaProducer> {
        Arc::clone(&self.producer.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// Replaces the producer when it can no longer produce: librdkafka flagged
    /// a fatal error, or the broker fenced its producer id/epoch (which can
    /// follow timed-out records). In-flight records of the old producer have
    /// already failed, so their batch is retried by the relay on the new one.
    fn recover_if_stuck(&self, current: &Arc<KafkaProducer>, error: Option<&KafkaError>) {
        let fatal = current.inner.client().fatal_error();
        let fenced = matches!(
            error.and_then(KafkaError::rdkafka_error_code),
            Some(
                RDKafkaErrorCode::ProducerFenced
                    | RDKafkaErrorCode::InvalidProducerEpoch
                    | RDKafkaErrorCode::OutOfOrderSequenceNumber
                    | RDKafkaErrorCode::UnknownProducerId
                    | RDKafkaErrorCode::InvalidProducerIdMapping
            )
        );
        if fatal.is_none() && !fenced {
            return;
        }
        let mut slot = self.producer.write().unwrap_or_else(|p| p.into_inner());
        if !Arc::ptr_eq(&slot, current) {
            return; // another worker already replaced it
        }
        tracing::warn!(
            ?fatal,
            ?error,
            "kafka producer can no longer produce; creating a new one"
        );
        match KafkaProducer::new(&self.settings.client_config()) {
            Ok(p) => {
                let old = std::mem::replace(&mut *slot, Arc::new(p));
                // Dropping a producer waits for its threads; keep that off the
                // async workers.
                tokio::task::spawn_blocking(move || drop(old));
            }
            Err(e) => tracing::error!(error = %e, "cannot create a new kafka producer"),
        }
    }
}

/// Errors a retry can never fix.
fn is_permanent(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::MessageSizeTooLarge
            | RDKafkaErrorCode::InvalidMessageSize
            | RDKafkaErrorCode::InvalidRecord
            | RDKafkaErrorCode::InvalidTopic
    )
}

/// Errors about one topic that an operator can fix (create the topic, grant
/// access): the message waits and retries, while other topics keep flowing.
fn is_topic_problem(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::UnknownTopic
            | RDKafkaErrorCode::UnknownTopicOrPartition
            | RDKafkaErrorCode::TopicAuthorizationFailed
    )
}

/// The outcome for a record librdkafka refused or failed, or None when the
/// failure is not the record's own and the batch must be retried.
fn rejection(e: &KafkaError) -> Option<Rejection> {
    match e {
        KafkaError::MessageProduction(code) if is_permanent(*code) => {
            Some(Rejection::permanent(format!("kafka: {code}")))
        }
        KafkaError::MessageProduction(code) if is_topic_problem(*code) => {
            Some(Rejection::retryable(format!("kafka: {code}")))
        }
        _ => None,
    }
}

fn headers(env: &Envelope, cloudevents: Option<&CloudEvents>) -> OwnedHeaders {
    let id = env.message_id.to_string();
    let mut h = OwnedHeaders::new_with_capacity(env.headers.len() + 7).insert(Header {
        key: "message-id",
        value: Some(id.as_str()),
    });
    if let Some(ct) = &env.content_type {
        h = h.insert(Header {
            key: "content-type",
            value: Some(ct.as_str()),
        });
    }
    let attributes: Vec<(String, String)> = cloudevents
        .map(|ce| ce.attributes(env))
        .into_iter()
        .flatten()
        .map(|(name, value)| (format!("ce_{name}"), value))
        .collect();
    // Kafka headers may repeat a name; a row header that spells one of the
    // event's attributes is left out rather than sent beside it.
    for (k, v) in &env.headers {
        if attributes.iter().any(|(a, _)| a.eq_ignore_ascii_case(k)) {
            continue;
        }
        h = h.insert(Header {
            key: k.as_str(),
            value: Some(v.as_str()),
        });
    }
    for (k, v) in &attributes {
        h = h.insert(Header {
            key: k.as_str(),
            value: Some(v.as_str()),
        });
    }
    h
}

impl Publisher for KafkaPublisher {
    async fn publish(&self, batch: &[Envelope]) -> Result<Vec<Verdict>, PublishError> {
        let producer = self.producer();
        let mut outcomes: Vec<Option<Verdict>> = vec![None; batch.len()];
        let mut pending = Vec::with_capacity(batch.len());
        // Keys with a record librdkafka refused here (too large, invalid):
        // their later records are not queued, so nothing overtakes the
        // refused one.
        let mut refused: std::collections::HashSet<&str> = std::collections::HashSet::new();
        for (i, env) in batch.iter().enumerate() {
            let key = env.ordering_key.as_deref();
            if key.is_some_and(|k| refused.contains(k)) {
                outcomes[i] = Some(Err(Rejection::retryable(
                    "held back behind an earlier refused record of its key",
                )));
                continue;
            }
            let (report, delivery) = oneshot::channel();
            let mut record =
                BaseRecord::<[u8], [u8], _>::with_opaque_to(&env.destination, Box::new(report))
                    .payload(&env.payload)
                    .headers(headers(env, self.cloudevents.as_ref()));
            if let Some(key) = &env.ordering_key {
                record = record.key(key.as_bytes());
            }
            match producer.inner.send(record) {
                Ok(()) => pending.push(async move { (i, delivery.await) }),
                Err((e, _)) if rejection(&e).is_some() => {
                    if let Some(k) = key {
                        refused.insert(k);
                    }
                    outcomes[i] = rejection(&e).map(Err);
                }
                Err((e, _)) => {
                    // Nothing after this record may be sent ahead of it; the
                    // records already queued still get their reports, but the
                    // batch as a whole is retried.
                    let _ = join_all(pending).await;
                    self.recover_if_stuck(&producer, Some(&e));
                    return Err(PublishError::new("kafka: cannot queue record", e));
                }
            }
        }
        let mut batch_error = None;
        let mut without_offset = 0usize;
        for (i, report) in join_all(pending).await {
            outcomes[i] = Some(match report {
                // librdkafka reports the records of a request that failed with
                // an uncertain outcome as delivered, with no offset, once a
                // later request to the partition succeeds ("implicit ack"): a
                // broker that checks idempotent sequence numbers would have
                // refused the later request had the earlier one been lost. Not
                // every Kafka-protocol broker checks them (librdkafka's mock
                // cluster does not), so only a report with an offset is a yes.
                Ok(Ok((_, offset))) if offset < 0 => {
                    without_offset += 1;
                    continue;
                }
                Ok(Ok((partition, offset))) => Ok(Receipt::Kafka { partition, offset }),
                Ok(Err(e)) => match rejection(&e) {
                    Some(r) => Err(r),
                    None => {
                        batch_error.get_or_insert(e);
                        continue;
                    }
                },
                Err(_canceled) => {
                    batch_error.get_or_insert(KafkaError::Canceled);
                    continue;
                }
            });
        }
        if let Some(e) = batch_error {
            self.recover_if_stuck(&producer, Some(&e));
            return Err(PublishError::new("kafka: delivery failed", e));
        }
        if without_offset > 0 {
            // The whole batch goes again, as for any uncertain failure: the
            // rest of each key stays behind these records.
            return Err(PublishError::msg(format!(
                "kafka: {without_offset} record(s) reported delivered without an offset \
                 (implicitly acknowledged after an uncertain failure); not taken as confirmed"
            )));
        }
        Ok(outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Err(Rejection::retryable("no delivery report"))))
            .collect())
    }

    /// One topic is one lane: the idempotent producer fails every later record
    /// of a partition after a failed one, and a key maps to one partition.
    fn same_lane(&self, a: &Envelope, b: &Envelope) -> bool {
        a.destination == b.destination
    }

    async fn ready(&self) -> Result<(), PublishError> {
        let producer = self.producer();
        tokio::task::spawn_blocking(move || {
            producer
                .inner
                .client()
                .fetch_metadata(None, Duration::from_secs(5))
                .map(|_| ())
        })
        .await
        .map_err(|e| PublishError::new("kafka: metadata task failed", e))?
        .map_err(|e| PublishError::new("kafka: brokers unreachable", e))
    }

    async fn close(&self) {
        // Dropping a producer purges what it has not delivered: flush first.
        let producer = self.producer();
        let timeout = self.settings.message_timeout.min(Duration::from_secs(10));
        let flushed = tokio::task::spawn_blocking(move || producer.inner.flush(timeout)).await;
        if let Ok(Err(e)) = flushed {
            tracing::warn!(error = %e, "kafka producer flush incomplete at shutdown");
        }
    }
}
