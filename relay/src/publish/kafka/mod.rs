//! Kafka through librdkafka's idempotent producer.
//!
//! `enable.idempotence=true` with `acks=all` makes librdkafka retry internally
//! without duplicating or reordering records within a partition, so a record's
//! delivery report is the broker's durable "yes". The ordering key is the record
//! key (so one key lands in one partition, in order); the message id travels in
//! the `message-id` header.
//!
//! With `enable.gapless.guarantee`, a record the broker refuses for good stops
//! the producer (a fatal error) instead of letting the records queued behind
//! it go ahead; the relay then builds a new producer (`recover_if_stuck`).
//!
//! Errors that can never succeed for a record (too large, invalid) are rejected
//! per message and recorded on the row; a broker's refusal for size covers a
//! whole record batch, so its records are first sent again alone (`alone`).
//! Every other error, including a timed
//! out record whose status is "possibly persisted", fails the whole batch: it is
//! retried, and a record that did reach the broker becomes a duplicate with the
//! same message id, never a loss. So is a record librdkafka reports delivered
//! without an offset: it inferred that, the broker never said it.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::time::Instant;

use futures::channel::oneshot;
use futures::future::join_all;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};

use super::cloudevents::CloudEvents;
use super::pace::{alone_too_slow, Pace};
use super::{Envelope, PublishError, Publisher, Receipt, Rejection, Verdict};

mod alone;
mod producer;
mod record;
mod settings;
mod setup;
mod silent;

use producer::KafkaProducer;
use record::{headers, is_batch_refusal, is_size_refusal, rejection};
pub use settings::{is_secret, InFlight, KafkaSettings, QueueTooSmall};
pub use silent::murmur2_partition;
use silent::{Held, Silent};

/// Publishes to Kafka; rebuilds the producer if librdkafka reports it fatally
/// failed (an idempotence violation it cannot repair).
pub struct KafkaPublisher {
    settings: KafkaSettings,
    producer: RwLock<Arc<KafkaProducer>>,
    /// CloudEvents binary mode, when on: `ce_` headers on every record.
    cloudevents: Option<CloudEvents>,
    /// The batch size a slow link can deliver within the message timeout.
    pace: Pace,
    /// Partitions that left records unanswered while others answered.
    silent: Silent,
    /// Whether the partitioner is one whose placement of a keyed record the
    /// relay can tell (see `silent`).
    predictable: bool,
    /// When the relay last warned that a refused record batch was larger
    /// than its topic takes (see `alone`).
    size_warned: std::sync::Mutex<Option<Instant>>,
    /// The producer that sends records refused together alone, once one
    /// was needed (see `alone`).
    alone: std::sync::Mutex<Option<Arc<KafkaProducer>>>,
    /// librdkafka's `message.max.bytes`: it refuses a larger record.
    max_message_bytes: Option<usize>,
    /// A producer that failed by itself, and the rebuilds since.
    failed: std::sync::Mutex<FailedBy>,
    /// Producers built in place of one that could no longer produce.
    replaced: std::sync::atomic::AtomicU64,
}

/// A producer's fatal error with no refused record behind it: the cluster
/// refused it a producer id (no IdempotentWrite ACL, a principal that may
/// write nowhere, a broker without idempotence). Every new producer meets
/// it again at once, so it is an outage: batches fail with its reason, the
/// broker shows as down, and producers are rebuilt with a backoff, until
/// one gets its id.
#[derive(Debug, Default)]
struct FailedBy {
    /// librdkafka's reason, while no producer since has had an id.
    reason: Option<String>,
    /// Producers built since it began.
    rebuilds: u32,
    /// When the last was built.
    rebuilt: Option<Instant>,
}

/// The longest wait between two producers built after one failed by itself.
const REBUILD_AT_MOST: Duration = Duration::from_secs(30);

/// The fatal error of `producer`, if it failed before it ever had a
/// producer id and not for the gapless guarantee (a refused record stopped
/// it, which a new producer does not meet). A producer that had an id and
/// then failed (a sequence out of step after timed-out records) is
/// replaced at once, as before.
fn failed_by_itself(producer: &KafkaProducer) -> Option<String> {
    match producer.inner.client().fatal_error() {
        Some((RDKafkaErrorCode::GaplessGuarantee, _)) | None => None,
        Some(_) if producer.setup.had_id() => None,
        Some((code, reason)) => Some(format!("{reason} ({code:?})")),
    }
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
        let settings = settings.with_passed_through_timeout();
        let config = settings.client_config();
        let producer = KafkaProducer::new(&config)?;
        let predictable = config.get("partitioner") == Some(silent::PREDICTABLE);
        // As librdkafka reads it (hex, suffixes), its default when unset;
        // none known if it cannot say.
        let max_message_bytes = settings::native(&config, "message.max.bytes");
        Ok(KafkaPublisher {
            silent: Silent::new(settings.message_timeout),
            settings,
            producer: RwLock::new(Arc::new(producer)),
            cloudevents: None,
            pace: Pace::default(),
            predictable,
            size_warned: std::sync::Mutex::new(None),
            alone: std::sync::Mutex::new(None),
            max_message_bytes,
            failed: std::sync::Mutex::new(FailedBy::default()),
            replaced: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// How many producers were built in place of one that could no longer
    /// produce.
    pub fn producers_replaced(&self) -> u64 {
        self.replaced.load(std::sync::atomic::Ordering::Relaxed)
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
        if failed_by_itself(current).is_some() {
            let _ = self.still_failed(current);
            return;
        }
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
        self.replace(&mut slot);
    }

    /// Why the producer cannot be used now, if it failed by itself (see
    /// [`FailedBy`]): its own fatal error, or a former producer's while the
    /// one built since has no id yet. Builds a new producer once the
    /// backoff since the last allows.
    fn still_failed(&self, current: &Arc<KafkaProducer>) -> Option<String> {
        let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(reason) = failed_by_itself(current) {
            let wait = Duration::from_millis(500)
                .saturating_mul(1 << failed.rebuilds.min(6))
                .min(REBUILD_AT_MOST);
            if failed.rebuilt.is_none_or(|at| at.elapsed() >= wait) {
                let mut slot = self.producer.write().unwrap_or_else(|p| p.into_inner());
                if Arc::ptr_eq(&slot, current) {
                    tracing::warn!(
                        reason,
                        rebuilds = failed.rebuilds,
                        next_in = ?wait,
                        "kafka producer failed by itself; creating a new one"
                    );
                    self.replace(&mut slot);
                    failed.rebuilds += 1;
                    failed.rebuilt = Some(Instant::now());
                }
            }
            failed.reason = Some(reason.clone());
            return Some(reason);
        }
        if let Some(reason) = &failed.reason {
            if !current.setup.has_id() {
                return Some(reason.clone());
            }
            tracing::info!(
                rebuilds = failed.rebuilds,
                "kafka producer has its producer id again"
            );
            *failed = FailedBy::default();
        }
        None
    }

    /// Puts a new producer in `slot`.
    fn replace(&self, slot: &mut Arc<KafkaProducer>) {
        match KafkaProducer::new(&self.settings.client_config()) {
            Ok(p) => {
                self.replaced
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let old = std::mem::replace(slot, Arc::new(p));
                // Dropping a producer waits for its threads; keep that off the
                // async workers.
                tokio::task::spawn_blocking(move || drop(old));
            }
            Err(e) => tracing::error!(error = %e, "cannot create a new kafka producer"),
        }
    }

    /// Waits until `producer` is set up to send `topics` at once (see
    /// `setup`), for up to half the time until `deadline`, leaving the
    /// other half for the records' answers.
    async fn set_up(
        &self,
        producer: &KafkaProducer,
        topics: &[&str],
        deadline: Instant,
    ) -> Result<(), setup::Missing> {
        let now = Instant::now();
        let wait_until = now + deadline.saturating_duration_since(now) / 2;
        producer
            .setup
            .wait(
                &producer.inner,
                topics.iter().copied(),
                self.settings.message_timeout,
                wait_until,
            )
            .await
    }

    /// `env` as a record, its delivery report to go to `report`.
    fn record<'e>(
        &self,
        env: &'e Envelope,
        report: oneshot::Sender<producer::Report>,
    ) -> Record<'e> {
        let mut record = BaseRecord::with_opaque_to(&env.destination, Box::new(report))
            .payload(env.payload.as_slice())
            .headers(headers(env, self.cloudevents.as_ref()));
        if let Some(key) = &env.ordering_key {
            record = record.key(key.as_bytes());
        }
        record
    }

    /// Hands every record of the batch to `producer`, then waits for
    /// their delivery reports; records the broker refused as too large or
    /// invalid
    /// together go again alone (see `alone`), by `deadline`.
    ///
    /// `illegal` holds the batch's topics whose names Kafka does not allow,
    /// each with why, and `absent` those the broker said do not exist:
    /// their records are refused here, for good and for now. `held` holds, per topic with its
    /// partition count, the silent partitions whose records are not sent.
    async fn send(
        &self,
        producer: &Arc<KafkaProducer>,
        batch: &[Envelope],
        illegal: &[(&str, &str)],
        absent: &[&str],
        held: &[(&str, i32, Held)],
        deadline: Instant,
    ) -> Result<Vec<Verdict>, PublishError> {
        let started = Instant::now();
        let mut outcomes: Vec<Option<Verdict>> = vec![None; batch.len()];
        let mut pending = Vec::with_capacity(batch.len());
        // The batch indices of the records handed to the producer.
        let mut handed_over = Vec::with_capacity(batch.len());
        // Keys with a record librdkafka refused here (too large, invalid):
        // their later records are not queued, so nothing overtakes the
        // refused one.
        let mut refused: std::collections::HashSet<&str> = std::collections::HashSet::new();
        // Records without a key placed on partitions that are not silent.
        let mut unkeyed = 0usize;
        // Payload bytes handed to the producer.
        let mut sent = 0usize;
        for (i, env) in batch.iter().enumerate() {
            let key = env.ordering_key.as_deref();
            if key.is_some_and(|k| refused.contains(k)) {
                outcomes[i] = Some(Err(Rejection::retryable(
                    "held back behind an earlier refused record of its key",
                )));
                continue;
            }
            if let Some((_, problem)) = illegal.iter().find(|(t, _)| *t == env.destination) {
                if let Some(k) = key {
                    refused.insert(k);
                }
                outcomes[i] = Some(Err(Rejection::permanent(format!(
                    "kafka: topic name {} {problem}",
                    record::shown(&env.destination)
                ))));
                continue;
            }
            if absent.contains(&env.destination.as_str()) {
                if let Some(k) = key {
                    refused.insert(k);
                }
                outcomes[i] = Some(Err(Rejection::retryable(format!(
                    "kafka: topic {:?} does not exist (UnknownTopicOrPartition)",
                    env.destination
                ))));
                continue;
            }
            let mut partition = None;
            let mut silent = None;
            if let Some((_, partitions, held)) = held.iter().find(|h| h.0 == env.destination) {
                match key {
                    Some(k) => silent = held.holds(k.as_bytes(), *partitions),
                    None => {
                        partition = held.open_partition(unkeyed);
                        unkeyed += 1;
                    }
                }
            }
            if let Some((p, wait, since)) = silent {
                outcomes[i] = Some(Err(Rejection::unanswered(format!(
                    "kafka: partition {p} of {:?} has left records unanswered for {:?}; \
                     held back unsent until it is tried again",
                    env.destination,
                    since.elapsed()
                ))
                .for_at_least(wait)));
                continue;
            }
            let (report, delivery) = oneshot::channel();
            let mut record = self.record(env, report);
            if let Some(p) = partition {
                record = record.partition(p);
            }
            match queue(&producer.inner, record, deadline).await {
                Ok(()) => {
                    sent += env.payload.len();
                    handed_over.push(i);
                    pending.push(async move { (i, delivery.await, Instant::now()) });
                }
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
                    let stopped = producer.inner.client().fatal_error().is_some();
                    let by_itself = failed_by_itself(producer);
                    self.recover_if_stuck(producer, Some(&e));
                    if let Some(reason) = by_itself {
                        return Err(failed_outage(&reason));
                    }
                    if stopped {
                        return Err(stopped_at_a_refusal());
                    }
                    return Err(PublishError::new("kafka: cannot queue record", e));
                }
            }
        }
        let handed = pending.len();
        let mut batch_error = None;
        // Records that failed with an error not of their own, by index, with
        // the partition each was for.
        let mut unanswered = Vec::new();
        // Partitions that confirmed a record while some are silent (also
        // one that fell silent while this batch waited).
        let mut answering: Vec<(&str, i32)> = Vec::new();
        let mut without_offset = 0usize;
        // Whether the broker refused a record, for good or for its
        // batch's size: an answer, even when nothing else of the batch
        // was confirmed.
        let mut broker_refused = false;
        // Records refused together with the rest of their record batch
        // (for its size, or one invalid record in it), with the partition
        // that refused them: settled by sending each alone. Whether any
        // refusal was for size.
        let mut too_large = Vec::new();
        let mut for_size = false;
        // For the pace: payload bytes delivered, when the last of them was,
        // and whether any record timed out.
        let (mut delivered, mut last_delivery, mut timed_out) = (0usize, started, false);
        // The reports that come by the deadline. A record still unanswered
        // then (its partition without a leader, its message timeout not up:
        // the timeout runs from the hand-over, after the claim) is not
        // waited for, so the batch answers in time with what the other
        // partitions confirmed, as for a record timed out.
        let reports = reports_by(pending, deadline).await;
        let mut reported = vec![false; batch.len()];
        for (i, _, _) in &reports {
            reported[*i] = true;
        }
        for &i in &handed_over {
            if reported[i] {
                continue;
            }
            timed_out = true;
            batch_error.get_or_insert(KafkaError::MessageProduction(
                RDKafkaErrorCode::MessageTimedOut,
            ));
            let partition = match (&batch[i].ordering_key, self.predictable) {
                (Some(key), true) => producer
                    .setup
                    .partitions(&batch[i].destination)
                    .map_or(-1, |n| murmur2_partition(key.as_bytes(), n)),
                _ => -1,
            };
            unanswered.push((i, partition, true));
        }
        for (i, report, at) in reports {
            match &report {
                Ok(Ok((partition, offset))) if *offset >= 0 => {
                    delivered += batch[i].payload.len();
                    last_delivery = last_delivery.max(at);
                    let answer = (batch[i].destination.as_str(), *partition);
                    if self.silent.any() && !answering.contains(&answer) {
                        answering.push(answer);
                    }
                }
                Ok(Err((e, _))) => {
                    timed_out |= e.rdkafka_error_code() == Some(RDKafkaErrorCode::MessageTimedOut);
                }
                _ => {}
            }
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
                Ok(Err((e, partition))) if e.rdkafka_error_code().is_some_and(is_batch_refusal) => {
                    broker_refused = true;
                    for_size |= e.rdkafka_error_code().is_some_and(is_size_refusal);
                    too_large.push((i, partition));
                    continue;
                }
                Ok(Err((e, partition))) => match rejection(&e) {
                    Some(r) => {
                        broker_refused = true;
                        Err(r)
                    }
                    None => {
                        // Only a record left until its timeout is a sign of
                        // a silent partition; one purged when the producer
                        // stopped (a refusal under the gapless guarantee)
                        // or failed otherwise is not.
                        let left =
                            e.rdkafka_error_code() == Some(RDKafkaErrorCode::MessageTimedOut);
                        batch_error.get_or_insert(e);
                        unanswered.push((i, partition, left));
                        continue;
                    }
                },
                Err(_canceled) => {
                    batch_error.get_or_insert(KafkaError::Canceled);
                    unanswered.push((i, -1, false));
                    continue;
                }
            });
        }
        // Records timed out while others of the batch were still being
        // delivered past half the message timeout: the link delivers fewer
        // bytes in that time than the batches in flight hold. (A partition
        // without a leader shows no such late deliveries: the other
        // partitions' records come back at once.)
        if timed_out && last_delivery - started >= self.settings.message_timeout / 2 {
            self.pace.slow_down(delivered, "kafka");
        } else if timed_out && delivered == 0 {
            // Not one record confirmed: a partition's records travel in
            // one produce request and are confirmed together, so a batch
            // of one hot key that the link cannot carry within the
            // message timeout shows no late deliveries, only this.
            self.pace.timed_out_whole(sent, "kafka");
        } else if batch_error.is_none() && without_offset == 0 {
            self.pace
                .speed_up(sent, started.elapsed(), self.settings.message_timeout);
        }
        if let Some(e) = batch_error {
            let by_itself = failed_by_itself(producer);
            self.recover_if_stuck(producer, Some(&e));
            // Records the broker confirmed with an offset are in the log:
            // publishing them again with the rest, at every retry of a
            // partition that stays offline, would repeat them without
            // bound. So when some were confirmed, only the unanswered ones
            // go again (their keys wait for them). So too when the broker
            // refused one (for good, or with its record batch for size):
            // sent whole again, the batch would meet the same refusal
            // forever. When neither, the whole batch
            // failed as in any outage.
            let confirmed = outcomes.iter().any(|o| matches!(o, Some(Ok(_))));
            // Purged by a producer that stopped at a refusal, of another
            // batch's record or a producer-id error: the broker answered,
            // so it is not an outage; the batch goes again on the new
            // producer.
            if !(confirmed || broker_refused || timed_out)
                && without_offset == 0
                && producer.inner.client().fatal_error().is_some()
            {
                return Err(match by_itself {
                    Some(reason) => failed_outage(&reason),
                    None => stopped_at_a_refusal(),
                });
            }
            if !(confirmed || broker_refused) || without_offset > 0 {
                let alone = (timed_out && handed == 1)
                    .then(|| alone_too_slow(sent, self.settings.message_timeout))
                    .flatten();
                return Err(match alone {
                    Some(hint) => PublishError::new(format!("kafka: delivery failed: {hint}"), e),
                    None => PublishError::new("kafka: delivery failed", e),
                });
            }
            let reason = format!("kafka: delivery failed: {e}");
            for (i, partition, left) in unanswered {
                // Its partition is silent while others answer: the next
                // batches hold its records back (see `silent`).
                if self.predictable && confirmed && left && partition >= 0 {
                    self.silent.unanswered(&batch[i].destination, partition);
                }
                outcomes[i] = Some(Err(Rejection::unanswered(reason.clone())));
            }
        }
        for (topic, partition) in answering {
            self.silent.answered(topic, partition);
        }
        if without_offset > 0 {
            // The whole batch goes again, as for any uncertain failure: the
            // rest of each key stays behind these records.
            return Err(PublishError::msg(format!(
                "kafka: {without_offset} record(s) reported delivered without an offset \
                 (implicitly acknowledged after an uncertain failure); not taken as confirmed"
            )));
        }
        if !too_large.is_empty() {
            // The refusal stopped the producer: the other workers' batches
            // get a new one now, not after failing on this one.
            self.recover_if_stuck(producer, None);
            self.send_alone(batch, &too_large, for_size, &mut outcomes, deadline)
                .await;
        }
        Ok(outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Err(Rejection::retryable("no delivery report"))))
            .collect())
    }
}

/// A batch met a producer that failed by itself (see [`FailedBy`]).
fn failed_outage(reason: &str) -> PublishError {
    PublishError::msg(format!(
        "kafka: the producer failed: {reason}; new producers are built with a backoff until one gets a producer id"
    ))
}

/// A batch whose records a stopped producer purged, or would not take:
/// given back unsent, to go again on the new producer at once, without
/// the backoff and the "broker down" of an outage.
fn stopped_at_a_refusal() -> PublishError {
    PublishError::unsent(
        "kafka: the producer stopped at a refusal (the gapless guarantee); \
         the batch goes again on a new producer",
    )
}

/// What `pending` yields by `deadline`, in the order of the batch: the
/// futures not done by then are dropped (their delivery reports, should
/// they come, go nowhere).
async fn reports_by<F, T>(pending: Vec<F>, deadline: Instant) -> Vec<(usize, T, Instant)>
where
    F: std::future::Future<Output = (usize, T, Instant)>,
{
    use futures::StreamExt;
    let mut waiting: futures::stream::FuturesUnordered<F> = pending.into_iter().collect();
    let mut done = Vec::with_capacity(waiting.len());
    while let Ok(Some(report)) = tokio::time::timeout_at(deadline, waiting.next()).await {
        done.push(report);
    }
    done.sort_by_key(|(i, _, _)| *i);
    done
}

/// How long a record refused for want of room in librdkafka's local queue
/// waits before it is handed over again.
const QUEUE_ROOM_WAIT: Duration = Duration::from_millis(2);

/// Hands `record` to `producer`, waiting for room in its local queue while
/// it is full (QUEUE_FULL: records of earlier batches not yet delivered,
/// or a queue passed through smaller than the window) until `deadline`.
/// Giving up at once would fail the batch as an outage and send again the
/// records of it already queued.
async fn queue<'e>(
    producer: &BaseProducer<producer::Deliveries>,
    mut record: Record<'e>,
    deadline: Instant,
) -> Result<(), (KafkaError, Record<'e>)> {
    loop {
        match producer.send(record) {
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                if Instant::now() + QUEUE_ROOM_WAIT < deadline =>
            {
                record = back;
                tokio::time::sleep(QUEUE_ROOM_WAIT).await;
            }
            other => return other,
        }
    }
}

/// A record as the relay hands it to librdkafka.
type Record<'e> = BaseRecord<'e, [u8], [u8], Box<oneshot::Sender<producer::Report>>>;

/// The topics of `batch`, each once, in the order they first appear.
fn topics_of<'b>(batch: impl Iterator<Item = &'b Envelope>) -> Vec<&'b str> {
    let mut topics: Vec<&str> = Vec::new();
    for env in batch {
        if !topics.contains(&env.destination.as_str()) {
            topics.push(&env.destination);
        }
    }
    topics
}

impl Publisher for KafkaPublisher {
    fn max_payload_bytes(&self) -> Option<(usize, &'static str)> {
        self.max_message_bytes
            .map(|b| (b, "librdkafka's message.max.bytes"))
    }

    fn batch_bytes(&self) -> Option<usize> {
        self.pace.limit()
    }

    async fn publish(&self, batch: &[Envelope]) -> Result<Vec<Verdict>, PublishError> {
        let deadline = Instant::now() + 2 * self.settings.message_timeout;
        self.publish_until(batch, deadline).await
    }

    /// Hands the batch to the producer once it is set up (see `setup`),
    /// waiting for that up to half the time until `deadline`. A batch that
    /// cannot wait longer is given back unsent while the set-up is younger
    /// than the message timeout, and fails as an outage after that. Once
    /// handed over, its records are answered within the message timeout.
    async fn publish_until(
        &self,
        batch: &[Envelope],
        deadline: Instant,
    ) -> Result<Vec<Verdict>, PublishError> {
        let mut producer = self.producer();
        if let Some(reason) = self.still_failed(&producer) {
            return Err(failed_outage(&reason));
        }
        if producer.inner.client().fatal_error().is_some() {
            self.recover_if_stuck(&producer, None);
            producer = self.producer();
        }
        let mut topics = topics_of(batch.iter());
        // A topic no broker can have is never asked for: librdkafka refuses
        // a name over 512 bytes before it asks, and the set-up would wait
        // for its metadata until the batch failed as in an outage.
        let illegal: Vec<(&str, &str)> = topics
            .iter()
            .filter_map(|t| record::illegal_topic(t).map(|problem| (*t, problem)))
            .collect();
        topics.retain(|t| !illegal.iter().any(|(i, _)| i == t));
        if let Err(missing) = self.set_up(&producer, &topics, deadline).await {
            let waited = missing.since.elapsed();
            return Err(if waited < self.settings.message_timeout {
                PublishError::unsent(format!(
                    "kafka: the producer is still getting {} ({waited:?} so far)",
                    missing.what
                ))
            } else {
                PublishError::msg(format!(
                    "kafka: the producer has been without {} for {waited:?}; brokers unreachable or slow",
                    missing.what
                ))
            });
        }
        let absent = producer.setup.absent(&topics);
        let mut held = Vec::new();
        if self.predictable && self.silent.any() {
            for topic in &topics {
                let Some(partitions) = producer.setup.partitions(topic) else {
                    continue;
                };
                // The partitions its keyed records go to: a silent one due
                // to be tried again is tried only by a batch that has some.
                let mut wanted = Vec::new();
                for env in batch.iter().filter(|e| e.destination == *topic) {
                    if let Some(key) = &env.ordering_key {
                        let p = murmur2_partition(key.as_bytes(), partitions);
                        if !wanted.contains(&p) {
                            wanted.push(p);
                        }
                    }
                }
                if let Some(h) = self.silent.hold(topic, partitions, &wanted) {
                    held.push((*topic, partitions, h));
                }
            }
        }
        self.send(&producer, batch, &illegal, &absent, &held, deadline)
            .await
    }

    /// One topic is one lane: the idempotent producer fails every later record
    /// of a partition after a failed one, and a key maps to one partition.
    fn same_lane(&self, a: &Envelope, b: &Envelope) -> bool {
        a.destination == b.destination
    }

    fn silent_partitions(&self) -> Vec<crate::publish::SilentPartition> {
        self.silent.list()
    }

    async fn ready(&self) -> Result<(), PublishError> {
        let producer = self.producer();
        if let Some(reason) = self.still_failed(&producer) {
            return Err(failed_outage(&reason));
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn largest_payload(properties: &[(&str, &str)]) -> Option<usize> {
        KafkaPublisher::new(KafkaSettings {
            brokers: "127.0.0.1:1".into(),
            properties: properties
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            message_timeout: Duration::from_secs(5),
            in_flight: InFlight::default(),
        })
        .expect("producer")
        .max_payload_bytes()
        .map(|(bytes, _)| bytes)
    }

    /// `message.max.bytes` as librdkafka reads it: its default when unset,
    /// and any way of writing a number it takes.
    #[tokio::test]
    async fn the_largest_payload_is_message_max_bytes_as_librdkafka_reads_it() {
        assert_eq!(largest_payload(&[]), Some(1_000_000));
        assert_eq!(
            largest_payload(&[("message.max.bytes", "2000000")]),
            Some(2_000_000)
        );
        assert_eq!(
            largest_payload(&[("message.max.bytes", "0x200000")]),
            Some(0x20_0000)
        );
    }
}
