//! Deadlines: a broker that never answers, a claim that comes back too
//! late, a shutdown mid-batch, and a database lost for a minute.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use super::{assert_key_order, enqueue_spread, start, start_with, Broker, Loop, MS};
use crate::engine::Settings;
use crate::health::Event;
use crate::source::memory::MemoryStore;

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

/// A batch still waiting for its rows to become durable (a claim that
/// could not show its commits flushed) when shutdown comes: the barrier's
/// session ends with the shutdown, so nothing could end that wait. The
/// batch is released at once, unpublished, instead of the worker sitting
/// out the whole grace and then abandoning it.
#[tokio::test(start_paused = true)]
async fn a_batch_waiting_for_durability_at_shutdown_is_released_at_once() {
    let settings = Settings::default();
    // On, with no barrier session serving it: every claim waits.
    let durable = crate::source::durable::Durable::new();
    let relay = start_with(
        settings.clone(),
        MemoryStore::default(),
        Broker::default(),
        durable,
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    relay.store.enqueue("k", 100);
    relay.idle.work.notify_one();
    relay
        .until(Duration::from_secs(1), |r| r.store.locked() == 1)
        .await;
    let took = relay.stop().await;
    assert!(
        took < 10 * MS,
        "stopped after {took:?} (grace {:?})",
        settings.shutdown_grace
    );
    assert_eq!((relay.store.waiting(), relay.store.locked()), (1, 0));
    assert_eq!(
        relay.broker.batches.load(Ordering::Relaxed),
        0,
        "nothing published"
    );
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

/// After a batch failed because the broker could not be reached, a worker
/// asks the broker (`Publisher::ready`) before it claims again. While the
/// broker stays down, each claim would only lock a batch, write the
/// failure onto every row of it (a dead row version each, for vacuum) and
/// release it: so none is made, and the backlog goes out once it is back.
#[tokio::test(start_paused = true)]
async fn a_broker_down_for_a_minute_is_asked_before_each_claim() {
    let settings = Settings::default();
    let workers = settings.pipeline + 1;
    let store = MemoryStore::default();
    store.set_statement_time(MS);
    enqueue_spread(&store, 3_000, 30);
    let broker = Broker::default();
    broker.down.store(true, Ordering::Relaxed);
    let relay = start(settings.clone(), store, broker);
    tokio::time::sleep(Duration::from_secs(60)).await;
    let tried = relay.broker.batches.load(Ordering::Relaxed);
    // One failed batch per worker at most; after it, questions only.
    assert!(
        (1..=workers).contains(&tried),
        "{tried} batches claimed and tried by {workers} workers against a broker down for 60 s"
    );
    assert_eq!(relay.stats.counted(Event::BatchFailed), tried as u64);
    relay.broker.down.store(false, Ordering::Relaxed);
    relay
        .until(Duration::from_secs(60), |r| r.store.waiting() == 0)
        .await;
    relay.stop().await;
    let answered = relay.broker.answered();
    let distinct: std::collections::HashSet<i64> = answered.iter().map(|a| a.0).collect();
    assert_eq!(distinct.len(), 3_000);
    assert_eq!(
        answered.len(),
        3_000,
        "nothing was sent while the broker was down"
    );
    assert_key_order(&answered);
}
