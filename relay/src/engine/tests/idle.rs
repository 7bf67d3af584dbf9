//! The idle relay: one worker polls, the others stand by, and one
//! notification for one row brings one claim.

use std::time::Duration;

use tokio::time::Instant;

use super::{start, Broker, MS};
use crate::engine::idle::STANDBY_RECHECK;
use crate::engine::Settings;
use crate::source::memory::MemoryStore;

#[tokio::test(start_paused = true)]
async fn an_idle_relay_polls_with_one_worker_at_the_longest_pause() {
    let settings = Settings::default();
    let workers = settings.pipeline + 1;
    let relay = start(settings.clone(), MemoryStore::default(), Broker::default());
    let from = Instant::now();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let polls =
        relay.claims_between(from, Instant::now()) + relay.looks_between(from, Instant::now());
    relay.stop().await;
    // One poller at pauses of [poll_interval/2, poll_interval] once its
    // backoff has grown, the others once per standby recheck; a start-up
    // claim each.
    let poller = (10_000 / (settings.poll_interval.as_millis() / 2)) as usize;
    let standby = (workers - 1) * (10 * 1000 / STANDBY_RECHECK.as_millis() as usize + 1);
    assert!(
        polls <= poller + standby + workers,
        "{polls} polls in 10 s of idle: more than one worker polls, or the pause never grew"
    );
    assert!(
        polls >= (10_000 / settings.poll_interval.as_millis()) as usize,
        "{polls} polls in 10 s of idle: nobody polls"
    );
}

/// An idle poll is one look outside any transaction, not a claim (BEGIN,
/// the claim, ROLLBACK): after each worker's claim at start-up found
/// nothing, an empty outbox is not claimed from again. A row that arrives
/// is looked at once and claimed once.
#[tokio::test(start_paused = true)]
async fn an_idle_relay_looks_instead_of_claiming() {
    let settings = Settings::default();
    let relay = start(settings.clone(), MemoryStore::default(), Broker::default());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let from = Instant::now();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let to = Instant::now();
    let claims = relay.claims_between(from, to);
    let looks = relay.looks_between(from, to);
    assert_eq!(
        claims, 0,
        "{claims} claims (and {looks} looks) in 10 s of an empty outbox: idle polls open transactions"
    );
    assert!(
        looks >= (10_000 / settings.poll_interval.as_millis()) as usize,
        "{looks} looks in 10 s of idle: nobody polls"
    );

    // A row arrives: the poller's next look sees it, and one claim takes it.
    let arrived = Instant::now();
    relay.store.enqueue("k", 100);
    relay
        .until(Duration::from_secs(1), |r| r.broker.answered().len() == 1)
        .await;
    let taken = relay
        .store
        .claims()
        .into_iter()
        .filter(|(at, rows)| *at >= arrived && *rows > 0)
        .count();
    assert_eq!(taken, 1, "one row, one claim that takes it");
    assert!(
        relay
            .store
            .looks()
            .iter()
            .any(|(at, ready)| *at >= arrived && *ready),
        "the claim was not preceded by a look that saw the row"
    );
    relay.stop().await;
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
