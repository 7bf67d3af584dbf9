//! Records the broker refused together, as too large or invalid, sent
//! again one per request.
//!
//! Kafka checks a topic's `max.message.bytes` (and its segment size)
//! against a whole record batch, not one record: librdkafka puts many
//! records of a partition in one batch, up to its own `batch.size`, and a
//! refusal covers every record in it. librdkafka does not split a refused
//! batch. So a refusal says only that one of its records, or their sum,
//! was too large; which one, the relay cannot tell. Its batch may even have
//! held records of other workers' batches, which share the producer. So too
//! InvalidRecord: one record without a key on a compacted topic, or with a
//! timestamp further off than the topic allows, and the broker refuses its
//! whole record batch (naming the record only in a field librdkafka does
//! not pass on).
//!
//! Dead-lettering them all would take records that are fine out of the
//! stream. Instead they go again on a producer of their own that puts one
//! record in each batch (`batch.num.messages=1`), kept for the next refusal
//! once made. A record refused there is refused for itself and goes to the
//! dead letters; the others are delivered. Like the main producer it keeps the
//! gapless guarantee: a refusal stops it (the next refusal gets a new one),
//! and the records behind the refused one, unsent, go again with the next
//! batch. What the broker has not answered by the batch's deadline goes
//! again too; what it answered stands.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures::channel::oneshot;
use futures::stream::{FuturesUnordered, StreamExt};
use rdkafka::error::KafkaError;
use rdkafka::producer::Producer;
use tokio::time::Instant;

use super::producer::KafkaProducer;
use super::record::is_batch_refusal;
use super::{topics_of, KafkaPublisher};
use crate::publish::{Envelope, Receipt, Rejection, Verdict};

impl KafkaPublisher {
    /// Settles the records at `refused` (indices into `batch`, which the
    /// broker refused together, as too large when `for_size`, each with the
    /// partition that refused it) by sending each again alone, to that
    /// partition, by `deadline`. A refused record with an earlier record of its key not
    /// confirmed is not sent: it would go ahead of that record. (A later
    /// record of its key cannot have been confirmed: a broker that checks
    /// idempotent sequence numbers refuses it out of sequence.)
    ///
    /// The partition is the one its key maps to, and for a record without
    /// a key one the relay placed it on, passing over silent partitions
    /// (see `silent`): placed afresh by librdkafka, which sees nothing wrong
    /// with a partition whose leader takes requests and never answers,
    /// every record without a key sent in the same moment would land on one
    /// random partition, the silent one among them.
    pub(super) async fn send_alone(
        &self,
        batch: &[Envelope],
        refused: &[(usize, i32)],
        for_size: bool,
        outcomes: &mut [Option<Verdict>],
        deadline: Instant,
    ) {
        let mut waiting: HashSet<&str> = HashSet::new();
        let mut alone = Vec::new();
        for (i, env) in batch.iter().enumerate() {
            let key = env.ordering_key.as_deref();
            if let Some(&(_, partition)) = refused.iter().find(|r| r.0 == i) {
                if key.is_some_and(|k| waiting.contains(k)) {
                    outcomes[i] = Some(Err(Rejection::unanswered(
                        "kafka: refused together with the other records of its record batch; \
                         to be sent alone after an earlier record of its key",
                    )));
                } else {
                    alone.push((i, partition));
                }
            } else if !matches!(outcomes[i], Some(Ok(_))) {
                if let Some(k) = key {
                    waiting.insert(k);
                }
            }
        }
        if alone.is_empty() {
            return;
        }
        let verdicts = match self.produce_alone(batch, &alone, deadline).await {
            Ok(verdicts) => verdicts,
            Err(reason) => {
                let e = Rejection::unanswered(format!(
                    "kafka: refused together with the other records of its record batch; \
                     cannot send it alone yet: {reason}"
                ));
                alone.iter().map(|_| Err(e.clone())).collect()
            }
        };
        let through = verdicts.iter().filter(|v| v.is_ok()).count();
        let too_large = verdicts
            .iter()
            .filter(|v| v.as_ref().is_err_and(|r| r.permanent))
            .count();
        if for_size && through > 0 && self.warn_of_batch_size() {
            tracing::warn!(
                refused = refused.len(),
                sent_alone = alone.len(),
                delivered_alone = through,
                too_large_alone = too_large,
                "kafka: the broker refused a record batch as too large, yet records of it \
                 went through one per request; if this repeats, the producer's batches \
                 are larger than the topic takes: set --kafka-config batch.size below \
                 the topic's max.message.bytes"
            );
        }
        for ((i, _), verdict) in alone.into_iter().zip(verdicts) {
            outcomes[i] = Some(verdict);
        }
    }

    /// Whether to warn that batches exceed the topic's limit: at most once
    /// a minute, for a producer so set up meets it with every batch.
    fn warn_of_batch_size(&self) -> bool {
        let mut last = self.size_warned.lock().unwrap_or_else(|p| p.into_inner());
        let due = last.is_none_or(|at| at.elapsed() >= Duration::from_secs(60));
        if due {
            *last = Some(Instant::now());
        }
        due
    }

    /// The producer that puts one record in each request: kept while it
    /// can produce, so that its set-up (producer id, topics) carries over
    /// from one refusal to the next; a new one after a refusal stopped it.
    fn alone_producer(&self) -> Result<Arc<KafkaProducer>, String> {
        let mut slot = self.alone.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = slot.as_ref() {
            if p.inner.client().fatal_error().is_none() {
                return Ok(Arc::clone(p));
            }
        }
        let mut config = self.settings.client_config();
        config.set("batch.num.messages", "1");
        let producer = Arc::new(KafkaProducer::new(&config).map_err(|e| e.to_string())?);
        *slot = Some(Arc::clone(&producer));
        Ok(producer)
    }

    /// Sends `batch[i]` to partition `p` (librdkafka's choice when
    /// negative) for each `(i, p)` of `alone`, on a producer that puts one
    /// record in each request, and returns their verdicts in that order,
    /// as far as the broker answered by `deadline`; an error when that
    /// producer cannot be set up by half the time until then.
    async fn produce_alone(
        &self,
        batch: &[Envelope],
        alone: &[(usize, i32)],
        deadline: Instant,
    ) -> Result<Vec<Verdict>, String> {
        let producer = self.alone_producer()?;
        let topics = topics_of(alone.iter().map(|&(i, _)| &batch[i]));
        self.set_up(&producer, &topics, deadline)
            .await
            .map_err(|missing| format!("the producer is without {}", missing.what))?;
        let mut pending = FuturesUnordered::new();
        let mut verdicts: Vec<Option<Verdict>> = vec![None; alone.len()];
        for (n, &(i, partition)) in alone.iter().enumerate() {
            let (report, delivery) = oneshot::channel();
            let mut record = self.record(&batch[i], report);
            if partition >= 0 {
                record = record.partition(partition);
            }
            match producer.inner.send(record) {
                Ok(()) => pending.push(async move { (n, delivery.await) }),
                Err((e, _)) => {
                    verdicts[n] = Some(Err(self.refused_alone(&e)));
                    // Nothing later may go ahead of it.
                    break;
                }
            }
        }
        // The answers as they come, until the deadline: what the broker
        // answered by then stands, the rest goes again.
        while let Ok(Some((n, report))) = tokio::time::timeout_at(deadline, pending.next()).await {
            verdicts[n] = Some(match report {
                Ok(Ok((partition, offset))) if offset >= 0 => {
                    Ok(Receipt::Kafka { partition, offset })
                }
                Ok(Err((e, _))) => Err(self.refused_alone(&e)),
                _ => Err(Rejection::unanswered(
                    "kafka: sent alone after a refusal, and not confirmed",
                )),
            });
        }
        Ok(verdicts
            .into_iter()
            .map(|v| {
                v.unwrap_or_else(|| {
                    Err(Rejection::unanswered(
                        "kafka: refused together with the other records of its record batch; \
                         not answered when sent alone",
                    ))
                })
            })
            .collect())
    }

    /// A record that failed when sent alone: too large for good when the
    /// broker refused it for its size; otherwise it goes again.
    fn refused_alone(&self, e: &KafkaError) -> Rejection {
        match e.rdkafka_error_code() {
            Some(code) if is_batch_refusal(code) => {
                Rejection::permanent(format!("kafka: {code} (refused when sent alone)"))
            }
            _ => Rejection::unanswered(format!("kafka: sent alone, not confirmed: {e}")),
        }
    }
}
