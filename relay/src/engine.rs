//! The relay loop: claim a batch, publish it, settle it, repeat.
//!
//! `pipeline + 1` workers run the loop side by side, each on its own Postgres
//! connection. At most `pipeline` batches are at the broker at once (a
//! semaphore, the confirm window); a slot frees as soon as the broker has
//! answered, so the extra worker's batch, claimed meanwhile, goes out while
//! the answered one settles, and the broker never waits on a claim or a
//! settle. Every worker holds one batch at most, so a crash repeats at most
//! `pipeline + 1` batches. Row locks keep the workers apart; the claim's
//! head-of-key rule keeps each key's rows in order across them (see
//! [`crate::source::claim`]).

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outbox_client::SchemaName;
use tokio::sync::watch;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::backoff::{delay_for, Backoff};
use crate::publish::{Envelope, Outcome, Publisher, Receipt};
use crate::source::claim::{ClaimLimits, Prepared, Queries};
use crate::source::ownership::{self, Owned, OwnershipSettings};
use crate::source::{self, listener, retention, Database};
use crate::Error;

/// How the relay loop behaves; see the `run` flags for what each default means.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Rows claimed and published per batch.
    pub batch_size: i64,
    /// Payload bytes per batch: a claim stops adding rows when the next one
    /// would pass this (a single larger row still goes, alone).
    pub batch_max_bytes: i64,
    /// Batches at the broker awaiting confirms at once (the confirm window);
    /// pipeline + 1 workers claim and settle around them, so at most
    /// pipeline + 1 batches are published and not yet settled.
    pub pipeline: usize,
    /// Longest pause between claims while the outbox is idle. Claims run back
    /// to back while they come back full; after a claim that was not full the
    /// pause is `poll_min`, and it doubles with every empty claim up to this.
    pub poll_interval: Duration,
    /// Shortest pause between claims: after one that took less than a full
    /// batch, so that a trickle is sent in batches of a few, not of one.
    pub poll_min: Duration,
    /// First retry delay of a message the broker rejected.
    pub retry_base: Duration,
    /// Longest retry delay of a rejected message.
    pub retry_max: Duration,
    /// Longest wait between reconnect attempts.
    pub reconnect_max: Duration,
    /// How long a batch may finish after shutdown is requested before it is
    /// abandoned (its rows are then published again by the next run).
    pub shutdown_grace: Duration,
    /// Upper bound on how long a stalled relay keeps its claimed rows locked.
    pub hold_limit: Duration,
    /// Broker rejections after which a message moves to the dead letters.
    pub max_attempts: i32,
    /// Whether a dead-lettered message holds back the later messages of its key.
    pub park_on_dead_letter: bool,
    /// How long a silent replica keeps its partitions (failover bound).
    pub lease: Duration,
    /// Keep published rows this long with their receipts; `None` deletes them
    /// on confirm.
    pub retention: Option<Duration>,
    /// Rows per delete statement of the retention cleanup.
    pub retention_cleanup_batch: i64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            batch_size: 500,
            batch_max_bytes: 8 * 1024 * 1024,
            pipeline: 3,
            poll_interval: Duration::from_millis(50),
            poll_min: Duration::from_millis(5),
            retry_base: Duration::from_secs(1),
            retry_max: Duration::from_secs(60),
            reconnect_max: Duration::from_secs(10),
            shutdown_grace: Duration::from_secs(5),
            hold_limit: Duration::from_secs(60),
            max_attempts: 10,
            park_on_dead_letter: true,
            lease: Duration::from_secs(5),
            retention: None,
            retention_cleanup_batch: 1000,
        }
    }
}

/// Counters a caller can read while the relay runs.
#[derive(Debug, Default)]
pub struct Stats {
    /// Rows claimed and not yet settled.
    pub in_flight: std::sync::atomic::AtomicI64,
    /// Whether the last attempt to reach Postgres from a worker succeeded.
    pub postgres_up: std::sync::atomic::AtomicBool,
    /// Set when a worker lost Postgres after having reached it, until one
    /// reaches it again (so recovery is logged once).
    postgres_lost: std::sync::atomic::AtomicBool,
    /// Whether the ownership session is up (the replica can claim).
    pub owner_up: std::sync::atomic::AtomicBool,
    /// Since when the broker has been failing whole batches, and why.
    pub broker_down: std::sync::Mutex<Option<(std::time::SystemTime, String)>>,
    /// Messages the broker confirmed and the relay deleted.
    pub published: AtomicU64,
    /// Messages the broker rejected (each attempt counts).
    pub rejected: AtomicU64,
    /// Confirmed messages kept because an older message of their key failed in
    /// the same batch; they will be published again.
    pub held_back: AtomicU64,
    /// Batches that failed as a whole (broker unreachable).
    pub batch_failures: AtomicU64,
    /// Messages moved to the dead letters.
    pub dead_lettered: AtomicU64,
    /// Batches dropped unpublished because the relay stalled past its hold limit
    /// between claiming and publishing them.
    pub stale_batches: AtomicU64,
}

impl Stats {
    /// Records whether the broker answered the last batch.
    fn note_broker(&self, error: Option<&crate::publish::PublishError>) {
        // Workers and the probe all report here; the log gets one line when
        // the broker goes away and one when it is back, whoever noticed.
        let mut down = self.broker_down.lock().unwrap_or_else(|p| p.into_inner());
        match (error, down.as_ref()) {
            (None, None) => {}
            (None, Some((since, _))) => {
                let down_for = since.elapsed().unwrap_or_default();
                tracing::info!(down_for = ?Duration::from_millis(down_for.as_millis() as u64), "broker reachable again");
                *down = None;
            }
            (Some(e), None) => {
                tracing::warn!(error = %e, "broker unreachable; messages wait in the outbox until it is back");
                *down = Some((std::time::SystemTime::now(), e.to_string()));
            }
            (Some(e), Some((since, _))) => {
                tracing::debug!(error = %e, "broker still unreachable");
                *down = Some((*since, e.to_string()));
            }
        }
    }

    /// Records whether a worker reached Postgres; like the broker, one log
    /// line per change (after the first connection), not one per worker.
    fn note_postgres(&self, worker: usize, error: Option<&tokio_postgres::Error>) {
        match error {
            None => {
                if !self.postgres_up.swap(true, Ordering::Relaxed)
                    && self.postgres_lost.swap(false, Ordering::Relaxed)
                {
                    tracing::info!("postgres reachable again");
                }
            }
            Some(e) => {
                if self.postgres_up.swap(false, Ordering::Relaxed) {
                    self.postgres_lost.store(true, Ordering::Relaxed);
                    tracing::warn!(worker, error = %source::PgError(e), "lost postgres; reconnecting");
                } else {
                    tracing::debug!(worker, error = %source::PgError(e), "postgres still unreachable");
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
        if !self.postgres_up.load(Ordering::Relaxed) {
            return Some("postgres unreachable".into());
        }
        if !self.owner_up.load(Ordering::Relaxed) {
            return Some("not yet part of the replica set".into());
        }
        None
    }

    /// Records a broker probe's answer.
    pub fn note_broker_probe(&self, error: Option<&crate::publish::PublishError>) {
        self.note_broker(error);
    }

    /// Since when the broker has been down, and the latest error.
    pub fn broker_down(&self) -> Option<(std::time::SystemTime, String)> {
        self.broker_down
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// A relay for one outbox schema and one broker.
pub struct Relay<P: Publisher> {
    pg: Database,
    schema: SchemaName,
    publisher: Arc<P>,
    settings: Settings,
    stats: Arc<Stats>,
}

struct Worker<P: Publisher> {
    id: usize,
    idle: Idle,
    owned: Owned,
    pg: Database,
    queries: Queries,
    publisher: Arc<P>,
    settings: Settings,
    stats: Arc<Stats>,
    /// The confirm window: `pipeline` slots, each held by a batch from its
    /// publish until the broker has answered.
    in_flight: Arc<tokio::sync::Semaphore>,
    /// The payload bytes all claimed batches share, in KiB: (pipeline + 1) x
    /// `batch_max_bytes`. A batch holds its share from claim to settle, so a
    /// message larger than one batch's limit (it goes alone) cannot be held
    /// by every worker at once.
    payload_budget: Arc<tokio::sync::Semaphore>,
    /// The budget's size in KiB.
    payload_budget_kib: u32,
}

/// KiB of the shared payload budget a batch of `bytes` takes (at least 1, at
/// most the whole budget).
fn budget_share(bytes: usize, budget_kib: u32) -> u32 {
    u32::try_from(bytes.div_ceil(1024))
        .unwrap_or(u32::MAX)
        .clamp(1, budget_kib.max(1))
}

enum BatchEnd {
    /// Nothing to publish; `behind` when rows are waiting behind another
    /// batch in flight (older rows of their keys), so work will be there as
    /// soon as it settles.
    Empty { behind: bool },
    /// A batch was settled; `more` when more is probably waiting: the claim
    /// took as much as a batch may hold, or left rows behind another batch.
    Settled { more: bool },
}

/// How the workers share the waiting while the outbox is idle: one of them at
/// a time (the holder of `poller`) claims at pauses that grow from
/// `poll_min` to `poll_interval`; the others stand by until `work` hands
/// them something. A full batch, a notification (NOTIFY) or an ownership
/// change wakes one more worker, never all of them for one row.
#[derive(Clone, Default)]
struct Idle {
    poller: Arc<tokio::sync::Mutex<()>>,
    work: Arc<tokio::sync::Notify>,
    /// Held by the worker whose claim is running. Two claims of one relay at
    /// once would each lock rows the other then finds blocked behind them
    /// (older rows of the same keys): with a few hot keys every claim came
    /// back empty while the rows piled up. One at a time, each claim takes
    /// what the batches in flight left free.
    claiming: Arc<tokio::sync::Mutex<()>>,
}

/// How long a standing-by worker waits at least before it claims anyway (or
/// the poll interval, if longer): a floor under every hand-off, in case one
/// is missed.
const STANDBY_RECHECK: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
enum BatchError {
    #[error("postgres: {}", source::PgError(.0))]
    Postgres(tokio_postgres::Error),
    #[error("broker: {0}")]
    Publish(#[from] crate::publish::PublishError),
}

impl From<tokio_postgres::Error> for BatchError {
    fn from(e: tokio_postgres::Error) -> Self {
        BatchError::Postgres(e)
    }
}

impl<P: Publisher> Relay<P> {
    /// A relay reading `schema` through `pg` and publishing with `publisher`.
    ///
    /// A plain `tokio_postgres::Config` connects without TLS unless it requires
    /// TLS; see [`Database`] for verified TLS from a connection string.
    pub fn new(
        pg: impl Into<Database>,
        schema: SchemaName,
        publisher: P,
        settings: Settings,
    ) -> Self {
        Relay {
            pg: pg.into(),
            schema,
            publisher: Arc::new(publisher),
            settings,
            stats: Arc::new(Stats::default()),
        }
    }

    /// The relay's counters.
    pub fn stats(&self) -> Arc<Stats> {
        Arc::clone(&self.stats)
    }

    /// The publisher, e.g. to inspect an in-memory one in tests.
    pub fn publisher(&self) -> Arc<P> {
        Arc::clone(&self.publisher)
    }

    /// Runs until `shutdown` is cancelled, then lets in-flight batches finish
    /// (up to the shutdown grace), closes the broker connection and returns.
    ///
    /// Fails only when the outbox schema is missing; lost connections to Postgres
    /// or the broker are retried with capped backoff for as long as it runs.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), Error> {
        let queries = Queries::new(
            &self.schema,
            self.settings.park_on_dead_letter,
            self.settings.retention.is_some(),
        );
        self.wait_for_schema(&queries, &shutdown).await?;

        let (owned_tx, owned) = watch::channel(Arc::new(Vec::new()));

        let idle = Idle::default();
        let tracker = TaskTracker::new();
        tracker.spawn(listener::run(
            self.pg.clone(),
            self.schema.notify_channel(),
            Arc::clone(&idle.work),
            self.settings.reconnect_max,
            shutdown.clone(),
        ));
        tracker.spawn(ownership::run(
            self.pg.clone(),
            self.schema.clone(),
            OwnershipSettings {
                lease: self.settings.lease,
            },
            owned_tx,
            Arc::clone(&self.stats),
            self.settings.reconnect_max,
            shutdown.clone(),
        ));
        tracker.spawn(probe_broker(
            Arc::clone(&self.publisher),
            Arc::clone(&self.stats),
            shutdown.clone(),
        ));
        // Exported from the start, so a dashboard reads 0 rather than nothing.
        metrics::counter!(crate::metrics::RETENTION_DELETED).increment(0);
        if let Some(retention) = self.settings.retention {
            tracker.spawn(retention::run(
                self.pg.clone(),
                queries.clone(),
                retention,
                self.settings.retention_cleanup_batch,
                self.settings.reconnect_max,
                shutdown.clone(),
            ));
        }
        let pipeline = self.settings.pipeline.max(1);
        let in_flight = Arc::new(tokio::sync::Semaphore::new(pipeline));
        let payload_budget_kib = self.payload_budget_kib();
        let payload_budget = Arc::new(tokio::sync::Semaphore::new(payload_budget_kib as usize));
        for id in 0..=pipeline {
            let worker = Worker {
                idle: idle.clone(),
                in_flight: Arc::clone(&in_flight),
                payload_budget: Arc::clone(&payload_budget),
                payload_budget_kib,
                id,
                owned: owned.clone(),
                pg: self.pg.clone(),
                queries: queries.clone(),
                publisher: Arc::clone(&self.publisher),
                settings: self.settings.clone(),
                stats: Arc::clone(&self.stats),
            };
            tracker.spawn(worker.run(shutdown.clone()));
        }
        tracing::info!(schema = %self.schema, pipeline = self.settings.pipeline, batch_size = self.settings.batch_size, "relay running");
        tracker.close();
        tracker.wait().await;
        self.publisher.close().await;
        tracing::info!(
            published = self.stats.published.load(Ordering::Relaxed),
            "relay stopped"
        );
        Ok(())
    }

    /// The shared payload budget in KiB: one batch's byte limit per worker.
    fn payload_budget_kib(&self) -> u32 {
        let workers = self.settings.pipeline.max(1) as i64 + 1;
        let kib = self.settings.batch_max_bytes.max(1).saturating_mul(workers) / 1024;
        // tokio's semaphore holds at most usize::MAX >> 3 permits.
        u32::try_from(kib)
            .unwrap_or(u32::MAX >> 4)
            .clamp(1, u32::MAX >> 4)
    }

    /// Waits for Postgres to answer, then fails fast if the outbox is missing.
    async fn wait_for_schema(
        &self,
        queries: &Queries,
        shutdown: &CancellationToken,
    ) -> Result<(), Error> {
        let mut backoff = Backoff::new(Duration::from_millis(200), self.settings.reconnect_max);
        let mut said = false;
        loop {
            match source::connect(&self.pg, self.settings.hold_limit).await {
                Ok(client) => {
                    source::check_session(&self.pg).await?;
                    return queries
                        .check_schema(&client)
                        .await
                        .map_err(|e| Error::SchemaMissing {
                            schema: self.schema.to_string(),
                            cause: e,
                        });
                }
                // At start-up, an error that repeats until someone fixes the
                // configuration (password, user, database) stops the relay
                // with the server's message; one a restarting server gives
                // is waited out, said once. Once running, every connection
                // error is retried: a running relay never exits on its own.
                Err(e) if !source::worth_waiting_for(&e) => return Err(Error::Postgres(e)),
                Err(e) => {
                    if !said {
                        tracing::warn!(error = %source::PgError(&e), "cannot reach postgres; waiting for it");
                        said = true;
                    } else {
                        tracing::debug!(error = %source::PgError(&e), "postgres still unreachable");
                    }
                    tokio::select! {
                        _ = shutdown.cancelled() => return Ok(()),
                        _ = tokio::time::sleep(backoff.next_delay()) => {}
                    }
                }
            }
        }
    }
}

impl<P: Publisher> Worker<P> {
    async fn run(mut self, shutdown: CancellationToken) {
        let mut reconnect = Backoff::new(Duration::from_millis(100), self.settings.reconnect_max);
        let mut broker = Backoff::new(Duration::from_millis(100), self.settings.reconnect_max);
        let mut idle = Backoff::new(self.settings.poll_min, self.settings.poll_interval);
        'connect: while !shutdown.is_cancelled() {
            let mut client = match source::connect(&self.pg, self.settings.hold_limit).await {
                Ok(c) => {
                    self.stats.note_postgres(self.id, None);
                    c
                }
                Err(e) => {
                    self.stats.note_postgres(self.id, Some(&e));
                    if sleep_or_cancel(reconnect.next_delay(), &shutdown).await {
                        break;
                    }
                    continue;
                }
            };
            let prepared = match self.queries.prepare(&client).await {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(worker = self.id, error = %source::PgError(&e), "cannot prepare the claim; retrying");
                    if sleep_or_cancel(reconnect.next_delay(), &shutdown).await {
                        break;
                    }
                    continue;
                }
            };
            reconnect.reset();
            while !shutdown.is_cancelled() {
                match self
                    .batch_until_grace(&mut client, &prepared, &shutdown)
                    .await
                {
                    Some(Ok(BatchEnd::Settled { more: true })) => {
                        broker.reset();
                        idle.reset();
                        // Probably more waiting: bring one more worker in.
                        self.idle.work.notify_one();
                    }
                    Some(Ok(BatchEnd::Settled { more: false })) => {
                        broker.reset();
                        idle.reset();
                        self.pause(idle.next_delay(), &shutdown).await;
                    }
                    Some(Ok(BatchEnd::Empty { behind: true })) => {
                        // The batch ahead hands work over when it settles;
                        // the pause is only a floor under that.
                        broker.reset();
                        self.pause(idle.next_delay(), &shutdown).await;
                    }
                    Some(Ok(BatchEnd::Empty { behind: false })) => {
                        broker.reset();
                        match self.idle.poller.clone().try_lock_owned() {
                            Ok(_polling) => self.pause(idle.next_delay(), &shutdown).await,
                            Err(_) => {
                                let standby = self.settings.poll_interval.max(STANDBY_RECHECK);
                                self.pause(standby, &shutdown).await
                            }
                        }
                    }
                    Some(Err(BatchError::Publish(e))) => {
                        // Stats::note_broker logged the change of state.
                        tracing::debug!(worker = self.id, error = %e, "broker unavailable; batch will be retried");
                        if sleep_or_cancel(broker.next_delay(), &shutdown).await {
                            break 'connect;
                        }
                    }
                    Some(Err(BatchError::Postgres(e))) => {
                        if client.is_closed() {
                            self.stats.note_postgres(self.id, Some(&e));
                            continue 'connect;
                        }
                        tracing::warn!(worker = self.id, error = %source::PgError(&e), "postgres error; batch will be retried");
                        // A fresh session re-prepares the statements: one
                        // whose cached plan went stale (a column changed type
                        // under it) would fail the same way on every batch.
                        if sleep_or_cancel(reconnect.next_delay(), &shutdown).await {
                            break 'connect;
                        }
                        continue 'connect;
                    }
                    None => {
                        tracing::warn!(
                            worker = self.id,
                            grace = ?self.settings.shutdown_grace,
                            "batch still in flight after the shutdown grace; abandoned, its rows stay in the outbox"
                        );
                        break 'connect;
                    }
                }
            }
        }
    }

    /// Waits `pause`, or less when work is handed over, ownership changes or
    /// the relay stops.
    async fn pause(&mut self, pause: Duration, shutdown: &CancellationToken) {
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = self.idle.work.notified() => {}
            _ = self.owned.changed() => {}
            _ = tokio::time::sleep(pause) => {}
        }
    }

    /// Runs one batch to completion; only if shutdown was requested *and* the
    /// grace period ran out is it dropped (rolling back its transaction).
    async fn batch_until_grace(
        &self,
        client: &mut Client,
        prepared: &Prepared,
        shutdown: &CancellationToken,
    ) -> Option<Result<BatchEnd, BatchError>> {
        let grace = self.settings.shutdown_grace;
        tokio::select! {
            biased;
            r = self.batch(client, prepared) => Some(r),
            _ = async { shutdown.cancelled().await; tokio::time::sleep(grace).await } => None,
        }
    }

    async fn batch(
        &self,
        client: &mut Client,
        prepared: &Prepared,
    ) -> Result<BatchEnd, BatchError> {
        let partitions = Arc::clone(&self.owned.borrow());
        if partitions.is_empty() {
            return Ok(BatchEnd::Empty { behind: false });
        }
        let tx = client.transaction().await?;
        let claimed_at = std::time::Instant::now();
        // Everything from the claim to the settle must end within half the
        // hold limit: past the full limit Postgres ends the session and
        // another replica may take the rows. Half leaves margin for the
        // settle and for the clocks of two machines.
        let deadline = tokio::time::Instant::from_std(claimed_at) + self.settings.hold_limit / 2;
        let limits = ClaimLimits {
            rows: self.settings.batch_size,
            bytes: self.settings.batch_max_bytes,
            park_recheck: self.settings.retry_max,
        };
        let claiming = self.idle.claiming.lock().await;
        let claimed = self
            .queries
            .claim(&tx, prepared, &limits, &partitions)
            .await?;
        drop(claiming);
        let holds = claimed.holds;
        let behind = claimed.blocked > holds.len();
        #[cfg(feature = "mutants")]
        let batch = crate::mutants::apply_watermark(claimed.batch);
        #[cfg(not(feature = "mutants"))]
        let batch = claimed.batch;
        if batch.is_empty() {
            // Rows set aside behind a blocked head leave the fresh path, so
            // the next claim reaches the other keys at once.
            let held = self.queries.hold(&tx, &holds).await?;
            tx.commit().await?;
            return Ok(if held > 0 {
                BatchEnd::Settled { more: true }
            } else {
                BatchEnd::Empty { behind }
            });
        }
        #[cfg(feature = "mutants")]
        if crate::mutants::active() == Some(crate::mutants::Mutant::AckBeforeConfirm) {
            let seqs: Vec<i64> = batch.iter().map(|e| e.seq).collect();
            self.queries.delete(&tx, &seqs).await?;
            tx.commit().await?;
            let _ = publish_in_waves(self.publisher.as_ref(), &batch).await;
            self.stats
                .published
                .fetch_add(seqs.len() as u64, Ordering::Relaxed);
            return Ok(BatchEnd::Settled { more: true });
        }
        // The batch's share of the payload budget, held until it settles.
        let bytes: usize = batch.iter().map(|e| e.payload.len()).sum();
        // The claim took all a batch may hold: by rows, or by bytes (the next
        // row, which the claim read but did not keep, would not have fit).
        let more = behind
            || batch.len() + holds.len() >= self.settings.batch_size as usize
            || bytes.saturating_mul(2)
                >= usize::try_from(self.settings.batch_max_bytes).unwrap_or(usize::MAX);
        let Ok(_share) = self
            .payload_budget
            .acquire_many(budget_share(bytes, self.payload_budget_kib))
            .await
        else {
            return Ok(BatchEnd::Settled { more: true }); // closed: never, the relay owns it
        };
        // Wait for a slot: while `pipeline` batches are at the broker, this one
        // stays claimed and ready. The slot is the confirm window: it is given
        // back once the broker has answered, and the settle runs outside it.
        let Ok(slot) = self.in_flight.acquire().await else {
            return Ok(BatchEnd::Settled { more: true }); // closed: never, the relay owns it
        };
        // A process stopped between claim and publish (SIGSTOP, a long GC-like
        // stall) may have lost its rows to another replica by now. Publishing
        // them would only make duplicates, so drop the batch.
        if tokio::time::Instant::now() >= deadline {
            self.stats.stale_batches.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(worker = self.id, stalled = ?claimed_at.elapsed(), "stalled past the hold limit after claiming; batch dropped unpublished");
            return Ok(BatchEnd::Settled { more: true });
        }
        self.stats
            .in_flight
            .fetch_add(batch.len() as i64, Ordering::Relaxed);
        let publish_started = std::time::Instant::now();
        let published = match tokio::time::timeout_at(
            deadline,
            publish_in_waves(self.publisher.as_ref(), &batch),
        )
        .await
        {
            Ok(published) => published,
            Err(_) => {
                // Connecting, opening a channel, a broker that blocked the
                // connection (resource alarm) or confirms that never come:
                // whatever held it up, the batch is abandoned before its
                // rows can pass to another replica, and the publisher drops
                // whatever could still send it.
                self.publisher.abandon().await;
                Err(crate::publish::PublishError::msg(format!(
                    "batch not answered within {:?} of its claim (half the hold limit); abandoned",
                    self.settings.hold_limit / 2
                )))
            }
        };
        metrics::histogram!(crate::metrics::PUBLISH)
            .record(publish_started.elapsed().as_secs_f64());
        self.stats
            .in_flight
            .fetch_sub(batch.len() as i64, Ordering::Relaxed);
        self.stats.note_broker(published.as_ref().err());
        let outcomes = match published {
            Ok(o) => o,
            Err(e) => {
                let seqs: Vec<i64> = batch.iter().map(|e| e.seq).collect();
                self.stats.batch_failures.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(crate::metrics::BATCH_FAILURES).increment(1);
                // Recording the reason is a courtesy to operators; if it fails the
                // rows are released by the rollback all the same.
                if self
                    .queries
                    .note_batch_error(&tx, &seqs, &e.to_string())
                    .await
                    .is_ok()
                {
                    tx.commit().await?;
                }
                return Err(e.into());
            }
        };
        #[cfg(feature = "mutants")]
        crate::mutants::after_ack();
        drop(slot);
        let plan = settle_plan(&batch, &outcomes, &self.settings);
        self.queries
            .settle_published(&tx, prepared, &plan.published)
            .await?;
        self.queries.fail(&tx, &plan.failed).await?;
        self.queries.hold(&tx, &holds).await?;
        self.queries.dead_letter(&tx, &plan.dead).await?;
        tx.commit().await?;
        self.stats
            .dead_lettered
            .fetch_add(plan.dead.len() as u64, Ordering::Relaxed);
        for (seq, reason) in &plan.dead {
            if let Some(env) = batch.iter().find(|e| e.seq == *seq) {
                tracing::error!(
                    message_id = %env.message_id,
                    destination = %env.destination,
                    attempts = env.attempts + 1,
                    reason = %reason,
                    "message moved to dead letters"
                );
            }
        }

        self.stats
            .published
            .fetch_add(plan.published.len() as u64, Ordering::Relaxed);
        record_settled(&batch, &plan);
        self.stats
            .rejected
            .fetch_add(plan.failed.len() as u64, Ordering::Relaxed);
        self.stats
            .held_back
            .fetch_add(plan.held as u64, Ordering::Relaxed);
        for (seq, reason, delay) in &plan.failed {
            if let Some(env) = batch.iter().find(|e| e.seq == *seq) {
                tracing::warn!(
                    message_id = %env.message_id,
                    destination = %env.destination,
                    attempts = env.attempts + 1,
                    retry_in = ?delay,
                    reason = %reason,
                    "broker rejected message"
                );
            }
        }
        tracing::debug!(
            worker = self.id,
            published = plan.published.len(),
            rejected = plan.failed.len(),
            held = plan.held,
            "batch settled"
        );
        Ok(BatchEnd::Settled { more })
    }
}

fn count_by_destination(
    batch: &[Envelope],
    pick: impl Fn(&Envelope) -> bool,
    result: &'static str,
) {
    let mut counts: std::collections::HashMap<&str, u64> = std::collections::HashMap::new();
    for env in batch.iter().filter(|e| pick(e)) {
        *counts.entry(env.destination.as_str()).or_default() += 1;
    }
    for (destination, n) in counts {
        metrics::counter!(crate::metrics::MESSAGES, "destination" => crate::metrics::destination_label(destination), "result" => result)
            .increment(n);
    }
}

fn record_settled(batch: &[Envelope], plan: &SettlePlan) {
    let deleted: HashSet<i64> = plan.published.iter().map(|p| p.0.seq).collect();
    let failed: HashSet<i64> = plan.failed.iter().map(|f| f.0).collect();
    let dead: HashSet<i64> = plan.dead.iter().map(|d| d.0).collect();
    count_by_destination(batch, |e| deleted.contains(&e.seq), "published");
    count_by_destination(batch, |e| failed.contains(&e.seq), "rejected");
    count_by_destination(batch, |e| dead.contains(&e.seq), "dead_lettered");
    metrics::counter!(crate::metrics::RETRIES).increment(plan.failed.len() as u64);
    let now = std::time::SystemTime::now();
    let latency = metrics::histogram!(crate::metrics::COMMIT_TO_CONFIRM);
    for env in batch.iter().filter(|e| deleted.contains(&e.seq)) {
        if let Ok(d) = now.duration_since(env.created_at) {
            latency.record(d.as_secs_f64());
        }
    }
}

/// What to do with each row of a published batch.
#[derive(Debug, Default, PartialEq)]
struct SettlePlan<'a> {
    /// Confirmed rows, with what the broker said.
    published: Vec<(&'a Envelope, Receipt)>,
    failed: Vec<(i64, String, Duration)>,
    dead: Vec<(i64, String)>,
    held: usize,
}

/// Which wave each message of `batch` goes out in. A key's messages stay in one
/// wave while they share a lane; a lane change moves the rest of the key to the
/// next wave. Messages without a key all go in the first.
fn plan_waves<P: Publisher>(publisher: &P, batch: &[Envelope]) -> Vec<usize> {
    let mut last: std::collections::HashMap<&str, (usize, usize)> =
        std::collections::HashMap::new();
    batch
        .iter()
        .enumerate()
        .map(|(i, env)| {
            let Some(key) = env.ordering_key.as_deref() else {
                return 0;
            };
            let wave = match last.get(key) {
                None => 0,
                Some(&(prev, w)) if publisher.same_lane(&batch[prev], env) => w,
                Some(&(_, w)) => w + 1,
            };
            last.insert(key, (i, wave));
            wave
        })
        .collect()
}

/// Publishes `batch` wave by wave (usually one wave): a wave goes out only after
/// the previous one is answered, and a key refused in one wave sends nothing in
/// later ones. `None` marks a message held back unsent.
async fn publish_in_waves<P: Publisher>(
    publisher: &P,
    batch: &[Envelope],
) -> Result<Vec<Option<Outcome>>, crate::publish::PublishError> {
    let waves = plan_waves(publisher, batch);
    let last_wave = waves.iter().copied().max().unwrap_or(0);
    if last_wave == 0 {
        return Ok(publisher
            .publish(batch)
            .await?
            .into_iter()
            .map(Some)
            .collect());
    }
    let mut outcomes: Vec<Option<Outcome>> = vec![None; batch.len()];
    let mut refused: HashSet<&str> = HashSet::new();
    for wave in 0..=last_wave {
        let members: Vec<usize> = (0..batch.len())
            .filter(|&i| waves[i] == wave)
            .filter(|&i| {
                batch[i]
                    .ordering_key
                    .as_deref()
                    .is_none_or(|k| !refused.contains(k))
            })
            .collect();
        if members.is_empty() {
            continue;
        }
        let sub: Vec<Envelope> = members.iter().map(|&i| batch[i].clone()).collect();
        let answers = publisher.publish(&sub).await?;
        for (&i, answer) in members.iter().zip(answers) {
            if answer.is_err() {
                if let Some(k) = batch[i].ordering_key.as_deref() {
                    refused.insert(k);
                }
            }
            outcomes[i] = Some(answer);
        }
    }
    Ok(outcomes)
}

/// Confirmed rows are deleted, rejected ones get an attempt recorded and a
/// backoff. Once a row of a key is rejected, the key's later rows are left as
/// they are: unsent ones (`None`) wait, and confirmed ones — possible only if the
/// broker refused one message of a lane and accepted the next — are not deleted
/// either, so they are published again after the refused one.
fn settle_plan<'a>(
    batch: &'a [Envelope],
    outcomes: &[Option<Outcome>],
    settings: &Settings,
) -> SettlePlan<'a> {
    let mut plan = SettlePlan::default();
    let mut blocked: HashSet<&str> = HashSet::new();
    for (env, outcome) in batch.iter().zip(outcomes) {
        if let Some(key) = env.ordering_key.as_deref() {
            if blocked.contains(key) {
                plan.held += 1;
                continue;
            }
        }
        let Some(outcome) = outcome else {
            plan.held += 1;
            continue;
        };
        match outcome {
            Ok(receipt) => plan.published.push((env, *receipt)),
            Err(rejection) => {
                if rejection.permanent || env.attempts + 1 >= settings.max_attempts {
                    plan.dead.push((env.seq, rejection.reason.clone()));
                } else {
                    let attempt = u32::try_from(env.attempts).unwrap_or(0);
                    let delay = delay_for(settings.retry_base, settings.retry_max, attempt);
                    plan.failed.push((env.seq, rejection.reason.clone(), delay));
                }
                if let Some(key) = env.ordering_key.as_deref() {
                    blocked.insert(key);
                }
            }
        }
    }
    plan
}

/// Checks the broker every 2 s so readiness reflects an outage even while no
/// batch is in flight to notice it.
async fn probe_broker<P: Publisher>(
    publisher: Arc<P>,
    stats: Arc<Stats>,
    shutdown: CancellationToken,
) {
    loop {
        let answer = tokio::time::timeout(Duration::from_secs(5), publisher.ready()).await;
        match answer {
            Ok(Ok(())) => stats.note_broker_probe(None),
            Ok(Err(e)) => stats.note_broker_probe(Some(&e)),
            Err(_) => stats.note_broker_probe(Some(&crate::publish::PublishError::msg(
                "broker did not answer a probe within 5s",
            ))),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
        }
    }
}

/// Sleeps for `d`; true when `shutdown` came first.
pub(crate) async fn sleep_or_cancel(d: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => true,
        _ = tokio::time::sleep(d) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::publish::Rejection;
    use std::time::SystemTime;

    fn env(seq: i64, key: Option<&str>) -> Envelope {
        Envelope {
            seq,
            message_id: uuid::Uuid::now_v7(),
            destination: "d".into(),
            ordering_key: key.map(str::to_owned),
            routing_key: String::new(),
            headers: vec![],
            payload: vec![],
            content_type: None,
            event_type: None,
            created_at: SystemTime::now(),
            attempts: 0,
        }
    }

    fn seqs(published: &[(&Envelope, Receipt)]) -> Vec<i64> {
        published.iter().map(|p| p.0.seq).collect()
    }

    fn routed(seq: i64, key: &str, rk: &str) -> Envelope {
        Envelope {
            routing_key: rk.into(),
            ..env(seq, Some(key))
        }
    }

    #[test]
    fn a_lane_change_starts_a_new_wave_for_that_key_only() {
        let p = crate::publish::memory::MemoryPublisher::new();
        let batch = vec![
            routed(1, "a", "x"),
            routed(2, "b", "x"),
            routed(3, "a", "x"),
            routed(4, "a", "y"),
            env(5, None),
            routed(6, "a", "y"),
            routed(7, "a", "x"),
        ];
        assert_eq!(plan_waves(&p, &batch), vec![0, 0, 0, 1, 0, 1, 2]);
    }

    #[tokio::test]
    async fn a_refused_message_is_never_overtaken_across_lanes() {
        let p = crate::publish::memory::MemoryPublisher::new();
        p.reject_destination("poison", Rejection::retryable("no route"));
        let first = Envelope {
            destination: "poison".into(),
            ..env(1, Some("k"))
        };
        let batch = vec![first, env(2, Some("k")), env(3, Some("other"))];
        let outcomes = publish_in_waves(&p, &batch).await.expect("published");
        assert!(matches!(outcomes[0], Some(Err(_))));
        assert!(outcomes[1].is_none(), "k's second message must not be sent");
        assert!(matches!(outcomes[2], Some(Ok(_))));
        let sent: Vec<i64> = p.published().iter().map(|e| e.seq).collect();
        assert_eq!(sent, vec![3]);
        let plan = settle_plan(&batch, &outcomes, &Settings::default());
        assert_eq!(seqs(&plan.published), vec![3]);
        assert_eq!(plan.held, 1);
    }

    #[test]
    fn a_rejection_holds_back_the_rest_of_its_key_only() {
        let batch = vec![
            env(1, Some("a")),
            env(2, Some("b")),
            env(3, Some("a")),
            env(4, None),
            env(5, Some("a")),
            env(6, Some("b")),
        ];
        let outcomes: Vec<Option<Outcome>> = vec![
            Err(Rejection::retryable("no route")),
            Ok(Receipt::Memory),
            Ok(Receipt::Memory),
            Err(Rejection::retryable("nack")),
            Ok(Receipt::Memory),
            Ok(Receipt::Memory),
        ]
        .into_iter()
        .map(Some)
        .collect();
        let plan = settle_plan(&batch, &outcomes, &Settings::default());
        assert_eq!(seqs(&plan.published), vec![2, 6]);
        assert_eq!(
            plan.failed.iter().map(|f| f.0).collect::<Vec<_>>(),
            vec![1, 4]
        );
        assert_eq!(plan.held, 2);
    }

    #[test]
    fn permanent_rejections_and_exhausted_attempts_go_to_dead_letters() {
        let settings = Settings::default();
        let mut tired = env(2, Some("k"));
        tired.attempts = settings.max_attempts - 1;
        let batch = [env(1, None), tired, env(3, None)];
        let plan = settle_plan(
            &batch,
            &[
                Some(Err(Rejection::permanent("too large"))),
                Some(Err(Rejection::retryable("no route"))),
                Some(Err(Rejection::retryable("no route"))),
            ],
            &settings,
        );
        assert_eq!(
            plan.dead.iter().map(|d| d.0).collect::<Vec<_>>(),
            vec![1, 2]
        );
        assert_eq!(plan.failed.iter().map(|f| f.0).collect::<Vec<_>>(), vec![3]);
    }
}
