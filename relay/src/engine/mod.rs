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

use std::sync::Arc;
use std::time::Duration;

use outbox_client::SchemaName;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::backoff::Backoff;
use crate::health::{Event, Stats};
use crate::publish::Publisher;
use crate::source::claim::Queries;
use crate::source::durable::{self, Durable};
use crate::source::floor::{self, Floor};
use crate::source::ownership::{self, Owned, OwnershipSettings};
use crate::source::store::{PgStore, Store};
use crate::source::{self, listener, retention, Database};
use crate::Error;

mod hooks;
mod idle;
mod plan;
mod record;
#[cfg(test)]
mod tests;
mod worker;

use idle::Idle;
use worker::Worker;

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
    /// batch, so that a trickle is sent in batches of a few, not of one. It
    /// ends sooner once, at the rate the last claim found rows, about
    /// 32 rows (`idle::GATHER`) are waiting.
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
    /// How often the claim floor is recomputed from the start of the index
    /// (see [`crate::source::floor`]); `None` runs with no floor, every
    /// claim scanning fresh rows from the start.
    pub claim_floor_rescan: Option<Duration>,
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
            claim_floor_rescan: Some(Duration::from_secs(60)),
        }
    }
}

/// A relay for one outbox schema and one broker.
pub struct Relay<P: Publisher> {
    pg: Database,
    schema: SchemaName,
    publisher: Arc<P>,
    settings: Settings,
    stats: Arc<Stats>,
    floor: Arc<Floor>,
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
            floor: Arc::new(Floor::default()),
        }
    }

    /// The claim floor its workers use (0 until first computed).
    pub fn floor(&self) -> Arc<Floor> {
        Arc::clone(&self.floor)
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
        if shutdown.is_cancelled() {
            // Stopped while waiting for Postgres: nothing ran.
            self.publisher.close().await;
            return Ok(());
        }

        let (owned_tx, owned) = watch::channel(Arc::new(Vec::new()));

        let idle = Idle::default();
        let tracker = TaskTracker::new();
        let essential = Essential::new(&shutdown);
        essential.spawn(
            &tracker,
            "listen",
            listener::run(
                self.pg.clone(),
                self.schema.notify_channel(),
                Arc::clone(&idle.work),
                self.settings.reconnect_max,
                shutdown.clone(),
            ),
        );
        essential.spawn(
            &tracker,
            "ownership",
            ownership::run(
                self.pg.clone(),
                self.schema.clone(),
                OwnershipSettings {
                    lease: self.settings.lease,
                },
                owned_tx,
                Arc::clone(&self.stats),
                self.settings.reconnect_max,
                shutdown.clone(),
            ),
        );
        // The longest a worker goes between two failed batches of one
        // outage: its broker backoff, then a batch that runs into its
        // deadline at half the hold limit.
        let quiet = self.settings.reconnect_max + self.settings.hold_limit / 2;
        essential.spawn(
            &tracker,
            "broker probe",
            probe_broker(
                Arc::clone(&self.publisher),
                Arc::clone(&self.stats),
                quiet,
                shutdown.clone(),
            ),
        );
        // Exported from the start, so a dashboard reads 0 rather than nothing.
        metrics::counter!(crate::metrics::RETENTION_DELETED).increment(0);
        if let Some(retention) = self.settings.retention {
            essential.spawn(
                &tracker,
                "retention",
                retention::run(
                    self.pg.clone(),
                    queries.clone(),
                    retention,
                    self.settings.retention_cleanup_batch,
                    self.settings.reconnect_max,
                    shutdown.clone(),
                ),
            );
        }
        let floor = Arc::clone(&self.floor);
        if let Some(rescan) = self.settings.claim_floor_rescan {
            essential.spawn(
                &tracker,
                "claim floor",
                floor::run(
                    self.pg.clone(),
                    self.schema.clone(),
                    Arc::clone(&floor),
                    owned.clone(),
                    rescan,
                    self.settings.reconnect_max,
                    shutdown.clone(),
                ),
            );
        }
        let durable = Arc::new(Durable::new());
        essential.spawn(
            &tracker,
            "durability barrier",
            durable::run(
                self.pg.clone(),
                Arc::clone(&durable),
                self.settings.hold_limit,
                self.settings.reconnect_max,
                shutdown.clone(),
            ),
        );
        let store = Arc::new(PgStore::new(
            self.pg.clone(),
            queries.clone(),
            self.settings.hold_limit,
        ));
        let workers = Workers {
            store,
            publisher: Arc::clone(&self.publisher),
            settings: self.settings.clone(),
            stats: Arc::clone(&self.stats),
            floor,
            durable,
            idle,
            owned,
        };
        workers.spawn(&tracker, &essential, &shutdown);
        tracing::info!(schema = %self.schema, pipeline = self.settings.pipeline, batch_size = self.settings.batch_size, "relay running");
        tracker.close();
        tracker.wait().await;
        self.publisher.close().await;
        tracing::info!(
            published = self.stats.counted(Event::Published),
            "relay stopped"
        );
        essential.outcome()
    }

    /// Waits for Postgres to answer, then fails fast if the outbox is missing.
    async fn wait_for_schema(
        &self,
        queries: &Queries,
        shutdown: &CancellationToken,
    ) -> Result<(), Error> {
        let mut backoff = Backoff::new(Duration::from_millis(200), self.settings.reconnect_max);
        let mut said = false;
        /// What start-up's checks found.
        enum Check {
            Ready,
            Wait(source::PgFault),
            Stop(Error),
        }
        // The checks take a few dozen round trips (two more connections,
        // the session probe, the schema): 11 s on a link with a 300 ms
        // round trip. The bound only has to end a wait on a connection
        // that will never answer.
        let bound = self.settings.hold_limit.max(Duration::from_secs(30));
        loop {
            // A server that accepts connections and answers nothing keeps
            // each wait here until its bound; shutdown does not wait with it.
            let connected = tokio::select! {
                c = source::connect(&self.pg, self.settings.hold_limit) => c,
                _ = shutdown.cancelled() => return Ok(()),
            };
            let fault = match connected {
                Ok(client) => {
                    // Bounded: a connection that stays open and silent (a
                    // balancer that lost its backend) would otherwise hold
                    // start-up for good. An unanswered check, or a
                    // connection lost meanwhile (a server restarting), is
                    // waited out like an unreachable server; only what
                    // repeats until someone fixes it (a pooler, a missing
                    // schema) stops the relay.
                    let checked = tokio::time::timeout(bound, async {
                        match source::check_session(&self.pg).await {
                            Ok(()) => {}
                            Err(source::SessionError::Postgres(e))
                                if source::worth_waiting_for(&e) =>
                            {
                                return Check::Wait(source::PgFault::Postgres(e))
                            }
                            Err(e) => return Check::Stop(e.into()),
                        }
                        match queries.check_schema(&client).await {
                            Ok(()) => Check::Ready,
                            Err(e) if source::worth_waiting_for(&e) => {
                                Check::Wait(source::PgFault::Postgres(e))
                            }
                            Err(e) => Check::Stop(Error::SchemaMissing {
                                schema: self.schema.to_string(),
                                cause: e,
                            }),
                        }
                    });
                    let checked = tokio::select! {
                        c = checked => c,
                        _ = shutdown.cancelled() => return Ok(()),
                    };
                    match checked {
                        Ok(Check::Ready) => return Ok(()),
                        Ok(Check::Stop(e)) => return Err(e),
                        Ok(Check::Wait(fault)) => fault,
                        Err(_) => source::PgFault::Unanswered(bound),
                    }
                }
                // At start-up, an error that repeats until someone fixes the
                // configuration (password, user, database) stops the relay
                // with the server's message; one a restarting server gives
                // is waited out, said once. Once running, every connection
                // error is retried: a running relay never exits on its own.
                Err(source::PgFault::Postgres(e)) if !source::worth_waiting_for(&e) => {
                    return Err(Error::Postgres(e))
                }
                Err(e) => e,
            };
            if !said {
                tracing::warn!(error = %fault, "cannot reach postgres; waiting for it");
                said = true;
            } else {
                tracing::debug!(error = %fault, "postgres still unreachable");
            }
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tokio::time::sleep(backoff.next_delay()) => {}
            }
        }
    }
}

/// The worker side of a relay: `pipeline + 1` workers sharing a store, a
/// publisher and their hand-offs. [`Relay::run`] starts them over Postgres;
/// the loop's tests start them over memory.
struct Workers<P: Publisher, S: Store> {
    store: Arc<S>,
    publisher: Arc<P>,
    settings: Settings,
    stats: Arc<Stats>,
    floor: Arc<Floor>,
    durable: Arc<Durable>,
    idle: Idle,
    owned: Owned,
}

impl<P: Publisher, S: Store> Workers<P, S> {
    /// Spawns every worker on `tracker`; each runs until `shutdown`, and
    /// one that ends before (a panic) stops the relay, as `essential` says.
    fn spawn(self, tracker: &TaskTracker, essential: &Essential, shutdown: &CancellationToken) {
        let pipeline = self.settings.pipeline.max(1);
        let in_flight = Arc::new(tokio::sync::Semaphore::new(pipeline));
        let payload_budget_kib = payload_budget_kib(&self.settings);
        let payload_budget = Arc::new(tokio::sync::Semaphore::new(payload_budget_kib as usize));
        for id in 0..=pipeline {
            let worker = Worker {
                idle: self.idle.clone(),
                floor: Arc::clone(&self.floor),
                durable: Arc::clone(&self.durable),
                in_flight: Arc::clone(&in_flight),
                payload_budget: Arc::clone(&payload_budget),
                payload_budget_kib,
                id,
                owned: self.owned.clone(),
                store: Arc::clone(&self.store),
                publisher: Arc::clone(&self.publisher),
                settings: self.settings.clone(),
                stats: Arc::clone(&self.stats),
            };
            essential.spawn(tracker, "worker", worker.run(shutdown.clone()));
        }
    }
}

/// The relay's own long-lived tasks, each meant to run until shutdown. One
/// that ends before it (a panic: a bug) would leave the relay running
/// without it: without ownership, on no partitions, its workers waking at
/// once on the closed channel; without the barrier, every batch waiting out
/// its time; without its workers, claiming nothing. So its end stops the
/// relay, with an error, for whatever supervises the process to start it
/// again.
struct Essential {
    shutdown: CancellationToken,
    ended: Arc<std::sync::Mutex<Option<Error>>>,
}

impl Essential {
    fn new(shutdown: &CancellationToken) -> Self {
        Essential {
            shutdown: shutdown.clone(),
            ended: Arc::default(),
        }
    }

    fn spawn(
        &self,
        tracker: &TaskTracker,
        task: &'static str,
        run: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        let (shutdown, ended) = (self.shutdown.clone(), Arc::clone(&self.ended));
        tracker.spawn(async move {
            let outcome = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(run)).await;
            let how = match outcome {
                Ok(()) if shutdown.is_cancelled() => return,
                Ok(()) => "ended".to_owned(),
                Err(panic) => {
                    let message = panic
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "(no message)".to_owned());
                    format!("panicked: {message}")
                }
            };
            tracing::error!(task, "the relay's {task} task {how}; stopping the relay");
            ended
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert(Error::TaskEnded { task, how });
            shutdown.cancel();
        });
    }

    /// The first task's end, if any task ended before shutdown.
    fn outcome(&self) -> Result<(), Error> {
        match self.ended.lock().unwrap_or_else(|p| p.into_inner()).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// The shared payload budget in KiB: one batch's byte limit per worker.
fn payload_budget_kib(settings: &Settings) -> u32 {
    let workers = settings.pipeline.max(1) as i64 + 1;
    let kib = settings.batch_max_bytes.max(1).saturating_mul(workers) / 1024;
    // tokio's semaphore holds at most usize::MAX >> 3 permits.
    u32::try_from(kib)
        .unwrap_or(u32::MAX >> 4)
        .clamp(1, u32::MAX >> 4)
}

/// Checks the broker every 2 s so readiness reflects an outage even while no
/// batch is in flight to notice it. Its yes counts once no batch has failed
/// for `quiet` (see [`Stats::note_broker_probe`]). Also copies the broker's
/// silent partitions into the heartbeat's figures.
async fn probe_broker<P: Publisher>(
    publisher: Arc<P>,
    stats: Arc<Stats>,
    quiet: Duration,
    shutdown: CancellationToken,
) {
    loop {
        match worker::ask_broker(publisher.as_ref()).await {
            Ok(()) => stats.note_broker_probe(None, quiet),
            Err(e) => stats.note_broker_probe(Some(&e), quiet),
        }
        stats.set_silent_partitions(publisher.silent_partitions());
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
        }
    }
}
