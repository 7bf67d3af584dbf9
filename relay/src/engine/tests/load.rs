//! Under load: a backlog and one hot key drain back to back, and a trickle
//! goes out within the shortest pause, in batches of several.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use super::{assert_key_order, enqueue_spread, start, Broker, MS};
use crate::engine::idle::STANDBY_RECHECK;
use crate::engine::Settings;
use crate::source::memory::MemoryStore;

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
    // After a claim that was not full the pause is at most poll_min. A row
    // committed just after a claim read the table waits for the rest of
    // that claim, its batch's settle, the pause and the next claim: one
    // worker polls a trickle, so nothing claims during its batch and pause.
    // (Each statement takes 1 ms here: the timer's resolution.)
    assert!(
        worst <= settings.poll_min + 3 * MS,
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
async fn a_stream_faster_than_the_pause_needs_is_claimed_once_a_batch_waits() {
    // 5,000 rows a second with a 50 ms shortest pause: every pause would
    // gather 125-250 rows, each of which waited up to the whole pause
    // although a batch of several was there within a few milliseconds.
    // The poller ends its pause once about a trickle's batch is waiting.
    // 15,000 rows go in at that rate; whole pauses would put the p99 wait
    // past half the pause, and one-by-one claims would show in the batches.
    let poll_min = Duration::from_millis(50);
    let settings = Settings {
        poll_min,
        poll_interval: poll_min * 4,
        ..Settings::default()
    };
    let store = MemoryStore::default();
    store.set_statement_time(MS / 10);
    let relay = start(settings.clone(), store, Broker::default());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut enqueued = std::collections::HashMap::new();
    for i in 0..15_000 {
        // Keys enough that batches need not wait for each other.
        let seq = relay.store.enqueue(&format!("k{}", i % 5_000), 100);
        enqueued.insert(seq, Instant::now());
        if i % 5 == 4 {
            tokio::time::sleep(MS).await;
        }
    }
    relay
        .until(Duration::from_secs(5), |r| r.store.waiting() == 0)
        .await;
    let answered = relay.broker.answered();
    let batches = relay.broker.batches.load(Ordering::Relaxed);
    relay.stop().await;
    let mut waits: Vec<Duration> = answered
        .iter()
        .map(|(seq, _, at)| *at - enqueued[seq])
        .collect();
    waits.sort();
    let p99 = waits[waits.len() * 99 / 100];
    eprintln!(
        "p99 wait {p99:?}, {} rows in {batches} batches",
        answered.len()
    );
    assert!(
        p99 < poll_min / 2,
        "p99 wait {p99:?}: the workers kept their whole pause while batches of {} waited",
        answered.len() / batches.max(1)
    );
    // Not one by one either: about a trickle's batch each.
    assert!(
        batches * crate::engine::idle::GATHER / 2 <= answered.len(),
        "{} rows in {batches} batches: the pause ended before a batch was waiting",
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
async fn a_trickle_is_claimed_by_one_worker_at_a_time() {
    // 1,000 rows a second for 5 s, never a full batch. Each worker whose
    // batch was not full used to pause the shortest pause and claim again,
    // so one by one (each brought in by a standby recheck) every worker
    // joined the cadence, and the batches shrank to a quarter of what one
    // poller gathers: four times the batches, each with its own round trips.
    let settings = Settings::default();
    let workers = settings.pipeline + 1;
    let store = MemoryStore::default();
    store.set_statement_time(MS / 10);
    let relay = start(settings.clone(), store, Broker::default());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let seconds = 5;
    for i in 0..seconds * 1000 {
        relay.store.enqueue(&format!("k{}", i % 50), 100);
        tokio::time::sleep(MS).await;
    }
    relay
        .until(Duration::from_secs(5), |r| r.store.waiting() == 0)
        .await;
    let batches = relay.broker.batches.load(Ordering::Relaxed);
    relay.stop().await;
    // One poller: at most one claim per shortest pause. The standing-by
    // workers each claim once per recheck, and once more when they stop.
    let poller = seconds * 1000 / settings.poll_min.as_millis() as usize;
    let standby = (workers - 1) * (seconds * 1000 / STANDBY_RECHECK.as_millis() as usize + 2);
    assert!(
        batches <= poller + standby,
        "{batches} batches for a trickle of {seconds} s: more than one worker kept the shortest pause (one would make at most {poller}, plus {standby} rechecks)"
    );
}

#[tokio::test(start_paused = true)]
async fn a_trickle_to_a_slow_broker_overlaps_its_batches() {
    // The broker answers each batch after 20 ms, four times the shortest
    // pause. One poller would publish a batch, wait out its answer, pause,
    // and only then claim again: every row would wait for the batch ahead
    // of it. Batches slower than the pause bring the other workers in, so
    // nearly every batch goes out while another is still waiting for its
    // answer. (With one poller, 54-87 % did, through the standby
    // rechecks; with the workers brought in, over 99 %.)
    let settings = Settings::default();
    let store = MemoryStore::default();
    store.set_statement_time(MS / 10);
    let broker = Broker::default();
    *broker
        .answer_after
        .lock()
        .unwrap_or_else(|p| p.into_inner()) = 20 * MS;
    let relay = start(settings, store, broker);
    tokio::time::sleep(Duration::from_secs(1)).await;
    for i in 0..5_000 {
        // A key each: no row waits behind another batch of its key.
        relay.store.enqueue(&format!("k{i}"), 100);
        tokio::time::sleep(MS).await;
    }
    relay
        .until(Duration::from_secs(5), |r| r.store.waiting() == 0)
        .await;
    let batches = relay.broker.batches.load(Ordering::Relaxed);
    let overlapped = relay.broker.overlapped.load(Ordering::Relaxed);
    relay.stop().await;
    assert!(
        overlapped * 20 >= batches * 19,
        "only {overlapped} of {batches} batches went out while another waited for the slow broker: the claims waited for each batch in turn"
    );
    assert_key_order(&relay.broker.answered());
}
