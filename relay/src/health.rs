//! Health and readiness of one replica: what `/readyz`, the metrics, the
//! replica heartbeat and the logs say about it. The relay loop writes it
//! through methods; readers get values, never the atomics.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use crate::publish::{PublishError, SilentPartition};
use crate::source;
use crate::source::store::StoreError;

/// Counters and states of one replica, shared by its tasks.
#[derive(Debug, Default)]
pub struct Stats {
    /// Rows claimed and not yet settled.
    in_flight: AtomicI64,
    /// The workers with a Postgres session now, one bit per worker id
    /// (modulo 64): Postgres is reachable while any has one. One worker
    /// refused a connection (the server's connection limit) says nothing
    /// about the others' sessions.
    postgres_sessions: AtomicU64,
    /// Set when a worker lost Postgres after having reached it, until one
    /// reaches it again (so recovery is logged once).
    postgres_lost: AtomicBool,
    /// Whether the ownership session is up (the replica can claim).
    owner_up: AtomicBool,
    /// Whether the broker is down, and when it last failed a batch.
    broker: Mutex<Broker>,
    /// The broker's silent partitions at the probe's last check.
    silent: Mutex<Vec<SilentPartition>>,
    /// Messages the broker confirmed and the relay deleted.
    published: AtomicU64,
    /// Messages the broker rejected (each attempt counts).
    rejected: AtomicU64,
    /// Confirmed messages kept because an older message of their key failed in
    /// the same batch; they will be published again.
    held_back: AtomicU64,
    /// Batches that failed as a whole (broker unreachable).
    batch_failures: AtomicU64,
    /// Messages moved to the dead letters.
    dead_lettered: AtomicU64,
    /// Batches dropped unpublished because the relay stalled past its hold limit
    /// between claiming and publishing them.
    stale_batches: AtomicU64,
}

/// What the workers and the probe found of the broker.
#[derive(Debug, Default)]
struct Broker {
    /// Since when it has been down, and the latest error.
    down: Option<(SystemTime, String)>,
    /// When it last failed a batch as a whole, unless a batch went through
    /// since.
    failed_batch_at: Option<Instant>,
    /// Since when every batch and every probe has failed: unlike `down`,
    /// ended by the first probe that gets an answer.
    unanswering_since: Option<Instant>,
}

/// Something that happened to messages or batches, for [`Stats::count`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// Messages the broker confirmed and the relay settled.
    Published,
    /// Messages the broker rejected (an attempt each).
    Rejected,
    /// Confirmed messages kept behind an older failed message of their key.
    HeldBack,
    /// Messages moved to the dead letters.
    DeadLettered,
    /// Batches that failed as a whole.
    BatchFailed,
    /// Batches dropped unpublished after a stall past the hold limit.
    StaleBatch,
}

impl Stats {
    fn counter(&self, event: Event) -> &AtomicU64 {
        match event {
            Event::Published => &self.published,
            Event::Rejected => &self.rejected,
            Event::HeldBack => &self.held_back,
            Event::DeadLettered => &self.dead_lettered,
            Event::BatchFailed => &self.batch_failures,
            Event::StaleBatch => &self.stale_batches,
        }
    }

    /// Adds `n` to the counter of `event`.
    pub fn count(&self, event: Event, n: u64) {
        self.counter(event).fetch_add(n, Ordering::Relaxed);
    }

    /// How many `event`s so far.
    pub fn counted(&self, event: Event) -> u64 {
        self.counter(event).load(Ordering::Relaxed)
    }

    /// Rows claimed and not yet settled.
    pub fn in_flight(&self) -> i64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// `n` rows went to the broker (positive) or came back settled (negative).
    pub(crate) fn add_in_flight(&self, n: i64) {
        self.in_flight.fetch_add(n, Ordering::Relaxed);
    }

    /// Whether any worker has a Postgres session.
    pub fn postgres_up(&self) -> bool {
        self.postgres_sessions.load(Ordering::Relaxed) != 0
    }

    /// Whether the ownership session is up.
    pub fn owner_up(&self) -> bool {
        self.owner_up.load(Ordering::Relaxed)
    }

    /// Records how the broker answered a batch: an error when it failed
    /// the batch as a whole, None when it answered every message.
    pub(crate) fn note_batch(&self, error: Option<&PublishError>) {
        let mut broker = self.broker();
        broker.failed_batch_at = error.map(|_| Instant::now());
        Self::note_answer(&mut broker, error);
        Self::note_broker(&mut broker, error);
    }

    /// Records a broker probe's answer. A probe checks less than a batch (a
    /// connection, metadata): a broker that answers it may still fail every
    /// publish (a RabbitMQ resource alarm, a Kafka partition short of
    /// in-sync replicas). So a probe can report the broker down at any
    /// time, but back only when no batch has failed within `quiet`: longer
    /// than a worker can take between two failed batches of one outage
    /// (its backoff, then a batch that runs into its deadline). A batch
    /// that goes through reports it back at once.
    pub fn note_broker_probe(&self, error: Option<&PublishError>, quiet: Duration) {
        let mut broker = self.broker();
        Self::note_answer(&mut broker, error);
        let failing = broker
            .failed_batch_at
            .is_some_and(|at| at.elapsed() < quiet);
        if error.is_some() || !failing {
            Self::note_broker(&mut broker, error);
        }
    }

    fn note_answer(broker: &mut Broker, error: Option<&PublishError>) {
        broker.unanswering_since = match error {
            Some(_) => broker.unanswering_since.or_else(|| Some(Instant::now())),
            None => None,
        };
    }

    /// For how long every batch and probe has failed, if the latest did: a
    /// broker this replica cannot reach now, as opposed to one that
    /// [`Stats::broker_down`] still reports down while it proves itself
    /// back.
    pub fn broker_unanswering_for(&self) -> Option<Duration> {
        self.broker().unanswering_since.map(|at| at.elapsed())
    }

    fn broker(&self) -> std::sync::MutexGuard<'_, Broker> {
        self.broker.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Moves the broker's state. Workers and the probe all report here; the
    /// log gets one line when the broker goes away and one when it is back,
    /// whoever noticed.
    fn note_broker(broker: &mut Broker, error: Option<&PublishError>) {
        match (error, broker.down.as_ref()) {
            (None, None) => {}
            (None, Some((since, _))) => {
                let down_for = since.elapsed().unwrap_or_default();
                tracing::info!(down_for = ?Duration::from_millis(down_for.as_millis() as u64), "broker reachable again");
                broker.down = None;
            }
            (Some(e), None) => {
                tracing::warn!(error = %e, "broker unreachable; messages wait in the outbox until it is back");
                broker.down = Some((SystemTime::now(), e.to_string()));
            }
            (Some(e), Some((since, _))) => {
                tracing::debug!(error = %e, "broker still unreachable");
                broker.down = Some((*since, e.to_string()));
            }
        }
    }

    /// Records whether a worker reached Postgres (has a session) or lost
    /// or could not open its session. Postgres is reachable while any
    /// worker has a session; like the broker's, the log says when the last
    /// session went and when one came back, not once per worker.
    pub(crate) fn note_postgres(&self, worker: usize, error: Option<&StoreError>) {
        let bit = 1u64 << (worker % 64);
        match error {
            None => {
                let before = self.postgres_sessions.fetch_or(bit, Ordering::Relaxed);
                if before == 0 && self.postgres_lost.swap(false, Ordering::Relaxed) {
                    tracing::info!("postgres reachable again");
                }
            }
            Some(e) => {
                let before = self.postgres_sessions.fetch_and(!bit, Ordering::Relaxed);
                if before == bit {
                    self.postgres_lost.store(true, Ordering::Relaxed);
                    tracing::warn!(worker, error = %e, "lost postgres; reconnecting");
                } else if before & bit != 0 {
                    tracing::warn!(worker, error = %e, "a worker lost its postgres session; reconnecting");
                } else {
                    tracing::debug!(worker, error = %e, "postgres still unreachable for this worker");
                }
            }
        }
    }

    /// Why this replica is not ready, or None when it is: Postgres reachable
    /// and the ownership session up. The broker is deliberately not part of
    /// it: a relay whose broker is down is doing its job (the rows wait in
    /// Postgres), and as a sidecar its readiness is the app pod's, so a
    /// broker outage must not take the app out of service. Broker
    /// reachability is `outbox_connection_up{target="broker"}`, with an alert.
    pub fn not_ready_reason(&self) -> Option<String> {
        if !self.postgres_up() {
            return Some("postgres unreachable".into());
        }
        if !self.owner_up.load(Ordering::Relaxed) {
            return Some("not yet part of the replica set".into());
        }
        None
    }

    /// Since when the broker has been down, and the latest error.
    pub fn broker_down(&self) -> Option<(SystemTime, String)> {
        self.broker().down.clone()
    }

    /// The broker's silent partitions, as the probe last found them.
    pub fn set_silent_partitions(&self, silent: Vec<SilentPartition>) {
        *self.silent.lock().unwrap_or_else(|p| p.into_inner()) = silent;
    }
}

impl source::ownership::ReplicaReport for Stats {
    fn heartbeat(&self) -> source::ownership::Heartbeat {
        source::ownership::Heartbeat {
            in_flight: self.in_flight(),
            published: self.counted(Event::Published),
            broker_down: self.broker_down(),
            broker_unanswering_for: self.broker_unanswering_for(),
            silent_partitions: self
                .silent
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .map(|s| (s.topic.clone(), s.partition, s.since))
                .collect(),
        }
    }

    fn set_owner_up(&self, up: bool) {
        self.owner_up.store(up, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const QUIET: Duration = Duration::from_secs(3600);

    fn refused() -> PublishError {
        PublishError::msg("refused")
    }

    fn since(stats: &Stats) -> Option<SystemTime> {
        stats.broker_down().map(|(since, _)| since)
    }

    fn refused_connection() -> StoreError {
        StoreError::memory("sorry, too many clients already")
    }

    /// One worker whose connections the server refuses (its connection
    /// limit) while the others keep their sessions: the replica stays
    /// ready. It was not ready whenever that worker had reported last.
    #[test]
    fn one_worker_refused_a_connection_leaves_the_replica_ready() {
        let stats = Stats::default();
        source::ownership::ReplicaReport::set_owner_up(&stats, true);
        assert!(stats.not_ready_reason().is_some(), "no session yet");
        for worker in 0..3 {
            stats.note_postgres(worker, None);
        }
        for _ in 0..5 {
            stats.note_postgres(3, Some(&refused_connection()));
            assert_eq!(stats.not_ready_reason(), None);
            assert!(stats.postgres_up());
        }
        // Every session gone: not ready until one is back.
        for worker in 0..3 {
            stats.note_postgres(worker, Some(&refused_connection()));
        }
        assert_eq!(
            stats.not_ready_reason().as_deref(),
            Some("postgres unreachable")
        );
        stats.note_postgres(2, None);
        assert_eq!(stats.not_ready_reason(), None);
    }

    #[test]
    fn a_probe_that_succeeds_does_not_bring_back_a_broker_failing_batches() {
        let stats = Stats::default();
        stats.note_batch(Some(&refused()));
        let down = since(&stats).expect("down after a failed batch");
        stats.note_broker_probe(None, QUIET);
        assert_eq!(since(&stats), Some(down), "a probe's yes is not a batch's");
        stats.note_batch(Some(&refused()));
        assert_eq!(since(&stats), Some(down), "down since the first failure");
        stats.note_batch(None);
        assert_eq!(since(&stats), None, "a batch that went through");
    }

    #[test]
    fn a_probe_brings_back_what_a_probe_found_down() {
        let stats = Stats::default();
        stats.note_broker_probe(Some(&refused()), QUIET);
        assert!(since(&stats).is_some());
        stats.note_broker_probe(None, QUIET);
        assert_eq!(since(&stats), None);
    }

    #[test]
    fn the_first_answer_ends_unanswering_while_down_waits_for_quiet() {
        let stats = Stats::default();
        assert_eq!(stats.broker_unanswering_for(), None);
        stats.note_batch(Some(&refused()));
        stats.note_broker_probe(Some(&refused()), QUIET);
        let first = stats.broker_unanswering_for().expect("unanswering");
        stats.note_broker_probe(Some(&refused()), QUIET);
        assert!(
            stats.broker_unanswering_for().expect("still unanswering") >= first,
            "timed from the first failure"
        );
        // A probe that gets an answer: the broker answers this replica
        // again, though it still counts as down until no batch has failed
        // for QUIET.
        stats.note_broker_probe(None, QUIET);
        assert_eq!(stats.broker_unanswering_for(), None);
        assert!(since(&stats).is_some(), "down until quiet");
        stats.note_batch(Some(&refused()));
        assert!(stats.broker_unanswering_for().is_some());
        stats.note_batch(None);
        assert_eq!(stats.broker_unanswering_for(), None);
    }

    #[test]
    fn a_probe_brings_the_broker_back_once_batches_have_been_quiet() {
        let stats = Stats::default();
        stats.note_batch(Some(&refused()));
        // No batch since (the outbox went idle, or another replica took
        // the rows): past `quiet`, the probe's yes is all there is.
        std::thread::sleep(Duration::from_millis(20));
        stats.note_broker_probe(None, Duration::from_millis(10));
        assert_eq!(since(&stats), None);
    }
}
