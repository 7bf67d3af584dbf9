//! The relay loop's scheduling, over an in-memory store and broker with
//! paused tokio time: the pauses while idle, the hand-offs under load, the
//! deadlines of a broker that never answers and of a shutdown. Virtual time
//! makes each figure exact, so these tests can say how long something took
//! without depending on the machine.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::idle::Idle;
use super::{Settings, Workers};
use crate::health::Stats;
use crate::publish::{Envelope, PublishError, Publisher, Receipt, Verdict};
use crate::source::floor::Floor;
use crate::source::memory::MemoryStore;

mod deadlines;
mod idle;
mod load;

const MS: Duration = Duration::from_millis(1);

/// A broker that confirms everything after `answer_after`, records when it
/// answered each message, and can stall (never answer) or be down.
#[derive(Default)]
struct Broker {
    answered: Mutex<Vec<(i64, Option<String>, Instant)>>,
    batches: AtomicUsize,
    abandoned: AtomicUsize,
    answer_after: Mutex<Duration>,
    stalled: AtomicBool,
    down: AtomicBool,
    /// Batches waiting for their answer now.
    in_flight: AtomicUsize,
    /// Batches that arrived while another was waiting for its answer.
    overlapped: AtomicUsize,
}

impl Broker {
    fn answered(&self) -> Vec<(i64, Option<String>, Instant)> {
        self.answered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Publisher for Broker {
    async fn publish(&self, batch: &[Envelope]) -> Result<Vec<Verdict>, PublishError> {
        self.batches.fetch_add(1, Ordering::Relaxed);
        if self.down.load(Ordering::Relaxed) {
            return Err(PublishError::msg("test broker down"));
        }
        if self.stalled.load(Ordering::Relaxed) {
            std::future::pending::<()>().await;
        }
        let after = *self.answer_after.lock().unwrap_or_else(|p| p.into_inner());
        if self.in_flight.fetch_add(1, Ordering::Relaxed) > 0 {
            self.overlapped.fetch_add(1, Ordering::Relaxed);
        }
        if !after.is_zero() {
            tokio::time::sleep(after).await;
        }
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        let now = Instant::now();
        self.answered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(batch.iter().map(|e| (e.seq, e.ordering_key.clone(), now)));
        Ok(batch.iter().map(|_| Ok(Receipt::Memory)).collect())
    }

    async fn ready(&self) -> Result<(), PublishError> {
        if self.down.load(Ordering::Relaxed) {
            Err(PublishError::msg("test broker down"))
        } else {
            Ok(())
        }
    }

    async fn abandon(&self) {
        self.abandoned.fetch_add(1, Ordering::Relaxed);
    }

    async fn close(&self) {}
}

/// One relay's workers over memory, every partition owned.
struct Loop {
    store: MemoryStore,
    broker: Arc<Broker>,
    stats: Arc<Stats>,
    idle: Idle,
    shutdown: CancellationToken,
    tracker: TaskTracker,
    _owner: watch::Sender<Arc<Vec<i16>>>,
}

fn start(settings: Settings, store: MemoryStore, broker: Broker) -> Loop {
    start_with(
        settings,
        store,
        broker,
        crate::source::durable::Durable::off(),
    )
}

/// [`start`] with `durable` as the workers' durability barrier.
fn start_with(
    settings: Settings,
    store: MemoryStore,
    broker: Broker,
    durable: crate::source::durable::Durable,
) -> Loop {
    let (owner, owned) = watch::channel(Arc::new((0..64).collect()));
    let broker = Arc::new(broker);
    let stats = Arc::new(Stats::default());
    let idle = Idle::default();
    let shutdown = CancellationToken::new();
    let tracker = TaskTracker::new();
    Workers {
        store: Arc::new(store.clone()),
        publisher: Arc::clone(&broker),
        settings,
        stats: Arc::clone(&stats),
        floor: Arc::new(Floor::default()),
        durable: Arc::new(durable),
        idle: idle.clone(),
        owned,
    }
    .spawn(&tracker, &super::Essential::new(&shutdown), &shutdown);
    tracker.close();
    Loop {
        store,
        broker,
        stats,
        idle,
        shutdown,
        tracker,
        _owner: owner,
    }
}

impl Loop {
    /// Waits (in virtual time) until `done`, checking every millisecond;
    /// panics after `limit`.
    async fn until(&self, limit: Duration, done: impl Fn(&Loop) -> bool) -> Instant {
        let deadline = Instant::now() + limit;
        while !done(self) {
            assert!(Instant::now() < deadline, "not done within {limit:?}");
            tokio::time::sleep(MS).await;
        }
        Instant::now()
    }

    /// Asks the workers to stop and returns how long they took.
    async fn stop(&self) -> Duration {
        let asked = Instant::now();
        self.shutdown.cancel();
        self.tracker.wait().await;
        asked.elapsed()
    }

    fn claims_between(&self, from: Instant, to: Instant) -> usize {
        between(self.store.claims().iter().map(|c| c.0), from, to)
    }

    /// Looks outside a transaction (`Session::ready`) between the two.
    fn looks_between(&self, from: Instant, to: Instant) -> usize {
        between(self.store.looks().iter().map(|l| l.0), from, to)
    }
}

/// How many of `times` fall from `from` to `to`.
fn between(times: impl Iterator<Item = Instant>, from: Instant, to: Instant) -> usize {
    times.filter(|at| *at >= from && *at <= to).count()
}

fn enqueue_spread(store: &MemoryStore, rows: usize, keys: usize) {
    for i in 0..rows {
        store.enqueue(&format!("k{}", i % keys), 100);
    }
}

/// Per key, the seqs the broker answered must rise: each key's first
/// deliveries in order.
fn assert_key_order(answered: &[(i64, Option<String>, Instant)]) {
    let mut last: std::collections::HashMap<&str, i64> = Default::default();
    for (seq, key, _) in answered {
        let key = key.as_deref().unwrap_or("");
        if let Some(prev) = last.insert(key, *seq) {
            assert!(prev < *seq, "key {key}: {seq} went out after {prev}");
        }
    }
}
