//! An idle relay polls an empty outbox; each poll is a transaction that
//! claims nothing. The relay ends it without waiting for the server's answer,
//! and it must still end at once: a transaction left open between polls keeps
//! the locks of whatever rows its claim touched, shows to operators as a
//! session idle in transaction, and is ended, with its session, by the hold
//! limit.

use std::collections::HashMap;
use std::time::Duration;

use outbox_client::Message;
use outbox_tests::amqp::Fixture;
use outbox_tests::db::TestDb;
use outbox_tests::{fast_settings, InProcessRelay};

use super::PATIENCE;

/// Samples the transactions idle on `db`'s outbox table: sessions between
/// statements while a transaction that touched the table (a claim holds a
/// lock on it until the transaction ends) is still open. Returns (pid,
/// transaction start) pairs, the start as text.
async fn open_transactions(db: &TestDb) -> Vec<(i32, String)> {
    let table = format!("{}.messages", db.schema.quoted());
    db.client
        .query(
            "SELECT DISTINCT a.pid, a.xact_start::text \
             FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE l.locktype = 'relation' AND l.relation = $1::text::regclass \
               AND a.state = 'idle in transaction'",
            &[&table],
        )
        .await
        .expect("pg_stat_activity")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// Enqueues one message to the fixture's exchange.
async fn send(db: &TestDb, rabbit: &Fixture, payload: &str) {
    let m = Message::builder(rabbit.exchange.as_str())
        .payload(payload.as_bytes().to_vec())
        .build()
        .expect("valid");
    db.outbox().enqueue(&db.client, &m).await.expect("enqueue");
}

/// Before the relay ended an empty poll's transaction unawaited, each poll
/// waited for COMMIT. A version that only forgot the transaction, without
/// sending its end, left one transaction open across every poll: it was
/// seen in all of the samples below (checked by breaking `release`).
#[tokio::test]
async fn an_idle_relay_leaves_no_transaction_open_between_polls() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let relay = InProcessRelay::amqp(
        &db,
        outbox_relay::Settings {
            poll_min: Duration::from_millis(20),
            poll_interval: Duration::from_millis(50),
            ..fast_settings()
        },
    );
    // Warm up: the relay has its partitions and has polled a while.
    send(&db, &rabbit, "first").await;
    rabbit.expect_at_least(1, PATIENCE).await;

    // The same transaction seen in many samples spread over seconds is one
    // that outlived many polls. A correct relay's transaction lasts one
    // round trip, so it is seen in at most one or two samples even on a
    // machine that stalls a moment.
    const SAMPLES: usize = 20;
    let mut seen: HashMap<(i32, String), usize> = HashMap::new();
    for _ in 0..SAMPLES {
        for tx in open_transactions(&db).await {
            *seen.entry(tx).or_default() += 1;
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let longest = seen.values().copied().max().unwrap_or(0);
    assert!(
        longest <= SAMPLES / 2,
        "a relay transaction stayed open through {longest} of {SAMPLES} samples while idle: {seen:?}"
    );

    // The sessions still work: a message sent now goes out.
    send(&db, &rabbit, "second").await;
    rabbit.expect_at_least(2, PATIENCE).await;
    assert_eq!(db.count("messages").await, 0, "the outbox did not drain");

    relay.stop().await;
    rabbit.cleanup().await;
    db.cleanup().await;
}
