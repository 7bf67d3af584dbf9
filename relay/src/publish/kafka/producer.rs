//! librdkafka's producer, with delivery reports handed to futures.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::channel::oneshot;
use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::producer::{BaseProducer, DeliveryResult, Producer, ProducerContext, PurgeConfig};

use super::setup::SetUp;

/// A record's delivery report: its partition and offset, or why it failed
/// and the partition it was for (-1 if it had none yet).
pub(super) type Report = Result<(i32, i64), (KafkaError, i32)>;

/// Hands each delivery report to the future waiting for it, and each of
/// librdkafka's statistics to the producer's set-up.
pub(super) struct Deliveries {
    setup: Arc<SetUp>,
}

impl ClientContext for Deliveries {
    fn stats_raw(&self, statistics: &[u8]) {
        self.setup.statistics(statistics);
    }
}

impl ProducerContext for Deliveries {
    type DeliveryOpaque = Box<oneshot::Sender<Report>>;

    fn delivery(&self, result: &DeliveryResult<'_>, waiting: Self::DeliveryOpaque) {
        let report = match result {
            Ok(m) => Ok((m.partition(), m.offset())),
            Err((e, m)) => Err((e.clone(), m.partition())),
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
pub(super) struct KafkaProducer {
    pub(super) inner: Arc<BaseProducer<Deliveries>>,
    /// How far the producer has got towards sending at once.
    pub(super) setup: Arc<SetUp>,
    stop: Arc<AtomicBool>,
}

impl KafkaProducer {
    pub(super) fn new(config: &ClientConfig) -> Result<Self, KafkaError> {
        // Statistics carry the idempotence state the set-up waits for,
        // unless the operator turned them off (0).
        let ms = |key: &str| {
            config
                .get(key)
                .and_then(|ms| ms.trim().parse().ok())
                .map(Duration::from_millis)
        };
        let setup = SetUp::new(
            ms("statistics.interval.ms").unwrap_or(super::setup::STATISTICS_INTERVAL),
            ms("message.timeout.ms").unwrap_or(Duration::from_secs(300)),
        );
        let context = Deliveries {
            setup: Arc::clone(&setup),
        };
        let inner: Arc<BaseProducer<Deliveries>> = Arc::new(config.create_with_context(context)?);
        let stop = Arc::new(AtomicBool::new(false));
        let (producer, stopped) = (Arc::clone(&inner), Arc::clone(&stop));
        std::thread::Builder::new()
            .name("kafka-reports".into())
            .spawn(move || {
                let mut purged = false;
                while !stopped.load(Ordering::Relaxed) {
                    producer.poll(Duration::from_secs(1));
                    // After a fatal error (a refusal under the gapless
                    // guarantee) the records still queued wait out their
                    // message timeout, though this producer will never
                    // send them. Purged, their batches learn it now and go
                    // again on a new producer. Records of requests in
                    // flight at the refusal may be queued again after it
                    // (answered out of sequence), so the queue is purged at
                    // every poll while the producer lives.
                    if producer.client().fatal_error().is_some() {
                        if !purged {
                            tracing::debug!("kafka producer failed for good; purging its queue");
                            purged = true;
                        }
                        producer.purge(PurgeConfig::default().queue());
                    }
                }
            })
            .map_err(|e| KafkaError::ClientCreation(format!("delivery report thread: {e}")))?;
        Ok(KafkaProducer { inner, setup, stop })
    }
}

impl Drop for KafkaProducer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
