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

use super::idle::{Idle, STANDBY_RECHECK};
use super::{Settings, Workers};
use crate::health::{Event, Stats};
use crate::publish::{Envelope, PublishError, Publisher, Receipt, Verdict};
use crate::source::floor::Floor;
use crate::source::memory::MemoryStore;

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
        if !after.is_zero() {
            tokio::time::sleep(after).await;
        }
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
        idle: idle.clone(),
        owned,
    }
    .spawn(&tracker, &shutdown);
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
        self.store
            .claims()
            .iter()
            .filter(|(at, _)| *at >= from && *at <= to)
            .count()
    }
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

#[tokio::test(start_paused = true)]
async fn an_idle_relay_polls_with_one_worker_at_the_longest_pause() {
    let settings = Settings::default();
    let workers = settings.pipeline + 1;
    let relay = start(settings.clone(), MemoryStore::default(), Broker::default());
    let from = Instant::now();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let claims = relay.claims_between(from, Instant::now());
    relay.stop().await;
    // One poller at pauses of [poll_interval/2, poll_interval] once its
    // backoff has grown, the others once per standby recheck; a start-up
    // claim each.
    let poller = (10_000 / (settings.poll_interval.as_millis() / 2)) as usize;
    let standby = (workers - 1) * (10 * 1000 / STANDBY_RECHECK.as_millis() as usize + 1);
    assert!(
        claims <= poller + standby + workers,
        "{claims} claims in 10 s of idle: more than one worker polls, or the pause never grew"
    );
    assert!(
        claims >= (10_000 / settings.poll_interval.as_millis()) as usize,
        "{claims} claims in 10 s of idle: nobody polls"
    );
}

#[tokio::test(start_paused = true)]
async fn one_notification_for_one_row_brings_one_claim() {
    // Pauses long enough that no poll falls near the notification.
    let settings = Settings {
        poll_min: Duration::from_secs(10),
        poll_interval: Duration::from_secs(10),
        ..Settings::default()
    };
    let relay = start(settings, MemoryStore::default(), Broker::default());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = relay.store.claims().len();
    assert_eq!(before, 4, "each worker claims once at start-up");
    let notified = Instant::now();
    relay.store.enqueue("k", 100);
    relay.idle.work.notify_one();
    relay
        .until(Duration::from_secs(1), |r| r.broker.answered().len() == 1)
        .await;
    tokio::time::sleep(10 * MS).await;
    assert_eq!(
        relay.claims_between(notified, Instant::now()),
        1,
        "one row, one notification: one claim"
    );
    relay.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_backlog_drains_back_to_back_without_a_pause() {
    // A pause between full batches would show: the shortest is 100 ms here,
    // and each statement takes 1 ms.
    let settings = Settings {
        poll_min: Duration::from_millis(100),
        poll_interval: Duration::from_secs(1),
        ..Settings::default()
    };
    let batches = 40;
    let store = MemoryStore::default();
    store.set_statement_time(MS);
    enqueue_spread(&store, batches * settings.batch_size as usize, 100);
    let started = Instant::now();
    let relay = start(settings.clone(), store, Broker::default());
    let drained = relay
        .until(Duration::from_secs(60), |r| r.store.waiting() == 0)
        .await;
    let took = drained - started;
    relay.stop().await;
    eprintln!("backlog drained in {took:?}");
    // One claim at a time (the claim lock), each 1 ms; begin, settle and
    // commit overlap the next claim. A worker pausing once per batch would
    // add 100 ms for every batch it ran.
    assert!(
        took < batches as u32 * 4 * MS,
        "{batches} full batches took {took:?} of virtual time: the loop paused between them"
    );
    assert_eq!(
        relay.broker.answered().len(),
        batches * settings.batch_size as usize
    );
    assert_key_order(&relay.broker.answered());
}

#[tokio::test(start_paused = true)]
async fn a_trickle_goes_out_within_the_shortest_pause_in_batches_of_several() {
    let settings = Settings::default();
    let store = MemoryStore::default();
    store.set_statement_time(MS / 10);
    let relay = start(settings.clone(), store, Broker::default());
    tokio::time::sleep(Duration::from_secs(1)).await;
    // 1,000 rows a second for 5 s, no notifications: polling alone.
    let mut enqueued = std::collections::HashMap::new();
    for i in 0..5_000 {
        let seq = relay.store.enqueue(&format!("k{}", i % 50), 100);
        enqueued.insert(seq, Instant::now());
        tokio::time::sleep(MS).await;
    }
    relay
        .until(Duration::from_secs(5), |r| r.store.waiting() == 0)
        .await;
    let answered = relay.broker.answered();
    relay.stop().await;
    let worst = answered
        .iter()
        .map(|(seq, _, at)| *at - enqueued[seq])
        .max()
        .expect("rows went out");
    // After a claim that was not full the pause is at most poll_min, plus
    // the claim and settle statements.
    assert!(
        worst <= settings.poll_min + 2 * MS,
        "a row waited {worst:?}: the pause did not drop back to poll_min under a trickle"
    );
    let batches = relay.broker.batches.load(Ordering::Relaxed);
    assert!(
        batches * 2 <= answered.len(),
        "{} rows in {batches} batches: a trickle went out one by one",
        answered.len()
    );
    assert_key_order(&answered);
}

#[tokio::test(start_paused = true)]
async fn one_hot_key_drains_back_to_back_in_order() {
    let settings = Settings::default();
    let store = MemoryStore::default();
    store.set_statement_time(MS);
    let hot_batches = 10;
    for _ in 0..hot_batches * settings.batch_size {
        store.enqueue("hot", 100);
    }
    enqueue_spread(&store, 50, 10);
    let started = Instant::now();
    let relay = start(settings, store, Broker::default());
    let drained = relay
        .until(Duration::from_secs(120), |r| r.store.waiting() == 0)
        .await;
    relay.stop().await;
    let took = drained - started;
    eprintln!("hot key drained in {took:?}");
    // The hot key's batches can only go one after another, each four
    // statements of 1 ms (begin, claim, settle, commit). The worker that
    // settles one claims the next at once; the others, finding the key
    // taken, go on to other keys or wait for the hand-off. Any pause
    // between two hot batches shows.
    assert!(
        took < hot_batches as u32 * 5 * MS,
        "{hot_batches} batches of one key took {took:?}: the loop paused between them"
    );
    assert_key_order(&relay.broker.answered());
}

#[tokio::test(start_paused = true)]
async fn a_broker_that_never_answers_loses_the_batch_at_half_the_hold_limit() {
    let settings = Settings::default();
    let store = MemoryStore::default();
    for _ in 0..10 {
        store.enqueue("k", 100);
    }
    let broker = Broker::default();
    broker.stalled.store(true, Ordering::Relaxed);
    let started = Instant::now();
    let relay = start(settings.clone(), store, broker);
    relay
        .until(Duration::from_secs(120), |r| {
            r.stats.counted(Event::BatchFailed) == 1
        })
        .await;
    let at = started.elapsed();
    // Abandoned at half the hold limit after its claim, its rows released
    // (not settled, not lost) for the next claim.
    assert!(
        at >= settings.hold_limit / 2 && at <= settings.hold_limit / 2 + 10 * MS,
        "abandoned after {at:?}, not at half the {:?} hold limit",
        settings.hold_limit
    );
    assert_eq!(relay.broker.abandoned.load(Ordering::Relaxed), 1);
    assert_eq!(relay.store.waiting(), 10);
    relay.broker.stalled.store(false, Ordering::Relaxed);
    relay
        .until(Duration::from_secs(60), |r| r.store.waiting() == 0)
        .await;
    relay.stop().await;
    assert_eq!(
        relay.broker.answered().len(),
        10,
        "each row once, once answered"
    );
}

#[tokio::test(start_paused = true)]
async fn a_claim_stalled_past_the_deadline_is_dropped_unpublished() {
    let settings = Settings::default();
    let store = MemoryStore::default();
    store.slow_next_claim(settings.hold_limit / 2 + MS);
    for _ in 0..10 {
        store.enqueue("k", 100);
    }
    let relay = start(settings, store, Broker::default());
    relay
        .until(Duration::from_secs(120), |r| r.store.waiting() == 0)
        .await;
    relay.stop().await;
    // The first claim came back too late to publish safely; its rows went
    // back and a later claim published each of them once.
    assert_eq!(relay.stats.counted(Event::StaleBatch), 1);
    let answered = relay.broker.answered();
    assert_eq!(answered.len(), 10, "{answered:?}");
    assert_key_order(&answered);
}

/// Starts a relay, hands it one row for a broker that answers after
/// `answer_after`, and asks it to stop once the row is claimed; returns how
/// long the stop took.
async fn stop_mid_batch(settings: &Settings, answer_after: Duration) -> (Loop, Duration) {
    let broker = Broker::default();
    *broker
        .answer_after
        .lock()
        .unwrap_or_else(|p| p.into_inner()) = answer_after;
    let relay = start(settings.clone(), MemoryStore::default(), broker);
    tokio::time::sleep(Duration::from_secs(1)).await;
    relay.store.enqueue("k", 100);
    relay.idle.work.notify_one();
    relay
        .until(Duration::from_secs(1), |r| r.store.locked() == 1)
        .await;
    let took = relay.stop().await;
    (relay, took)
}

#[tokio::test(start_paused = true)]
async fn shutdown_waits_for_a_slow_broker_up_to_the_grace_and_no_longer() {
    let settings = Settings::default();
    let grace = settings.shutdown_grace;
    // A broker that answers within the grace: the batch settles, then the
    // relay stops.
    let (relay, took) = stop_mid_batch(&settings, grace / 2).await;
    assert!(took <= grace / 2 + 10 * MS, "{took:?}");
    assert_eq!(
        relay.store.waiting(),
        0,
        "the batch settled before the stop"
    );
    // One that would answer after the grace: the batch is abandoned at the
    // grace, its row back in the outbox, unlocked.
    let (relay, took) = stop_mid_batch(&settings, grace * 2).await;
    assert!(
        took >= grace && took <= grace + 10 * MS,
        "stopped after {took:?}, grace {grace:?}"
    );
    assert_eq!((relay.store.waiting(), relay.store.locked()), (1, 0));
}

#[tokio::test(start_paused = true)]
async fn a_lost_database_is_retried_with_capped_backoff_and_nothing_is_lost() {
    let settings = Settings::default();
    let workers = settings.pipeline + 1;
    let store = MemoryStore::default();
    store.set_statement_time(MS);
    enqueue_spread(&store, 3_000, 30);
    let relay = start(settings.clone(), store, Broker::default());
    // Lose it mid-drain, for a minute.
    relay
        .until(Duration::from_secs(10), |r| {
            r.broker.answered().len() >= 500
        })
        .await;
    relay.store.set_down(true);
    let opens = relay.store.opens();
    tokio::time::sleep(Duration::from_secs(60)).await;
    let retries = relay.store.opens() - opens;
    relay.store.set_down(false);
    relay
        .until(Duration::from_secs(60), |r| r.store.waiting() == 0)
        .await;
    relay.stop().await;
    // Per worker: 100 ms doubling to the 10 s cap, each delay drawn from
    // [d/2, d]: at most 8 tries to reach the cap (12.7 s), then one per 5 s.
    let cap = settings.reconnect_max.as_secs() as usize;
    let most = workers * (8 + 60 / (cap / 2));
    assert!(
        retries <= most,
        "{retries} reconnects by {workers} workers in 60 s: no backoff (at most {most})"
    );
    assert!(retries >= workers, "{retries} reconnects in 60 s");
    // Every row went out, each key in order on its first delivery; batches
    // cut off by the outage may go twice.
    let answered = relay.broker.answered();
    let distinct: std::collections::HashSet<i64> = answered.iter().map(|a| a.0).collect();
    assert_eq!(distinct.len(), 3_000);
    assert!(
        answered.len() - distinct.len() <= workers * settings.batch_size as usize,
        "{} duplicates: more than one batch per worker",
        answered.len() - distinct.len()
    );
}
