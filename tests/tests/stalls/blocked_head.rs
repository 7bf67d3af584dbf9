//! A key whose head is blocked (in backoff, parked or skipped) while
//! thousands of its messages wait or writers keep adding to it: the other
//! keys still go out, and the blocked key's messages never overtake its head.

use std::collections::HashSet;
use std::time::Duration;

use outbox_client::Message;
use outbox_tests::amqp::Fixture;
use outbox_tests::db::TestDb;
use outbox_tests::{eventually, fast_settings, InProcessRelay};
use rand::{Rng, SeedableRng};

use super::PATIENCE;

/// How the head of the hot key is blocked.
#[derive(Debug, Clone, Copy)]
enum Head {
    /// Refused, waiting out a long retry backoff.
    Backoff,
    /// Dead-lettered; its key's later messages are parked behind it.
    Parked,
    /// Dead-lettered; its key's later messages go ahead.
    Skipped,
}

/// A message of `key` for `destination`.
fn keyed(destination: &str, key: impl Into<String>, payload: Vec<u8>) -> Message {
    Message::builder(destination)
        .key(key)
        .payload(payload)
        .build()
        .expect("valid")
}

/// Enqueues the head of key "hot", addressed to `missing`, an exchange that
/// does not exist, so it can never go out; returns its id.
async fn enqueue_blocked_head(db: &TestDb, missing: &str) -> outbox_client::MessageId {
    db.outbox()
        .enqueue(&db.client, &keyed(missing, "hot", b"head".to_vec()))
        .await
        .expect("enqueue")
}

/// One key's head is blocked while 10 × batch_size more of its messages wait
/// behind it; 100 messages of 100 other keys committed afterwards must all go
/// out, and the blocked key's messages must not overtake its head. Before the
/// fix, every claim filled up with the blocked key's rows and returned
/// nothing, so the others waited forever (or until the key drained).
async fn blocked_head_does_not_stall_other_keys(head: Head) {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let missing = outbox_tests::unique("missing"); // never declared
    let batch_size = 100;
    let settings = outbox_relay::Settings {
        batch_size,
        max_attempts: match head {
            Head::Backoff => 100,
            Head::Parked | Head::Skipped => 1,
        },
        // A backoff far longer than the test: the head stays blocked.
        retry_base: Duration::from_secs(3600),
        retry_max: Duration::from_secs(3600),
        park_on_dead_letter: matches!(head, Head::Parked | Head::Backoff),
        ..fast_settings()
    };
    let outbox = db.outbox();
    let head_id = enqueue_blocked_head(&db, &missing).await;
    let behind: Vec<Message> = (0..10 * batch_size as usize + 500)
        .map(|i| {
            keyed(
                rabbit.exchange.as_str(),
                "hot",
                format!("hot-{i}").into_bytes(),
            )
        })
        .collect();
    outbox
        .enqueue_batch(&db.client, &behind)
        .await
        .expect("enqueue");

    let relay = InProcessRelay::amqp(&db, settings);
    // Let the head be refused first, so the others really come after it.
    assert!(
        eventually(PATIENCE, || async {
            let row = db
                .client
                .query_opt(
                    &format!(
                        "SELECT 1 FROM {} WHERE message_id = $1 AND attempts > 0 \
                         UNION ALL SELECT 1 FROM {}.dead_letters WHERE message_id = $1",
                        db.table(),
                        db.schema.quoted()
                    ),
                    &[&head_id.as_uuid()],
                )
                .await
                .expect("query");
            row.is_some()
        })
        .await,
        "the head was never refused"
    );
    let others: Vec<Message> = (0..100)
        .map(|i| {
            keyed(
                rabbit.exchange.as_str(),
                format!("other-{i}"),
                format!("other-{i}").into_bytes(),
            )
        })
        .collect();
    let other_ids = outbox
        .enqueue_batch(&db.client, &others)
        .await
        .expect("enqueue");
    let other_ids: HashSet<String> = other_ids.iter().map(|i| i.to_string()).collect();
    let arrived = |rabbit: &Fixture| {
        rabbit
            .deliveries()
            .iter()
            .filter(|d| other_ids.contains(&d.message_id))
            .count()
    };
    assert!(
        eventually(Duration::from_secs(30), || async {
            arrived(&rabbit) == 100
        })
        .await,
        "{head:?}: only {} of 100 other keys' messages arrived",
        arrived(&rabbit)
    );
    let hot_arrived = rabbit
        .deliveries()
        .iter()
        .filter(|d| d.payload.starts_with(b"hot-"))
        .count();
    match head {
        Head::Backoff | Head::Parked => assert_eq!(
            hot_arrived, 0,
            "{head:?}: the hot key's messages overtook its blocked head"
        ),
        Head::Skipped => {
            assert!(
                eventually(PATIENCE, || async {
                    rabbit
                        .deliveries()
                        .iter()
                        .filter(|d| d.payload.starts_with(b"hot-"))
                        .count()
                        >= behind.len()
                })
                .await,
                "skip mode: the hot key's later messages did not go ahead"
            );
            let order: Vec<usize> = rabbit
                .deliveries()
                .iter()
                .filter_map(|d| {
                    std::str::from_utf8(&d.payload)
                        .ok()?
                        .strip_prefix("hot-")?
                        .parse()
                        .ok()
                })
                .collect();
            assert!(
                order.windows(2).all(|w| w[0] < w[1]),
                "skip mode: the hot key's messages arrived out of order"
            );
        }
    }
    relay.stop().await;
    rabbit.cleanup().await;
    db.cleanup().await;
}

#[tokio::test]
async fn a_head_in_backoff_does_not_stall_other_keys() {
    blocked_head_does_not_stall_other_keys(Head::Backoff).await;
}

#[tokio::test]
async fn a_parked_head_does_not_stall_other_keys() {
    blocked_head_does_not_stall_other_keys(Head::Parked).await;
}

#[tokio::test]
async fn a_skipped_dead_letter_does_not_stall_other_keys() {
    blocked_head_does_not_stall_other_keys(Head::Skipped).await;
}

/// Writers keep committing to a key whose head is blocked while others flow:
/// the blocked key's stream must neither stall the others nor get ahead of its
/// head, and every claim stays small (the blocked rows are set aside once).
#[tokio::test]
async fn a_steady_stream_on_a_blocked_key_does_not_stall_others() {
    outbox_tests::init_logging();
    let seed = outbox_tests::seed();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let missing = outbox_tests::unique("missing");
    let relay = InProcessRelay::amqp(
        &db,
        outbox_relay::Settings {
            batch_size: 50,
            max_attempts: 1,
            park_on_dead_letter: true,
            ..fast_settings()
        },
    );
    let outbox = db.outbox();
    enqueue_blocked_head(&db, &missing).await;
    let mut other_ids = HashSet::new();
    for round in 0..40 {
        let hot: Vec<Message> = (0..rng.random_range(20..80))
            .map(|i| {
                keyed(
                    rabbit.exchange.as_str(),
                    "hot",
                    format!("hot-{round}-{i}").into_bytes(),
                )
            })
            .collect();
        outbox.enqueue_batch(&db.client, &hot).await.expect("hot");
        let others: Vec<Message> = (0..rng.random_range(1..10))
            .map(|i| {
                keyed(
                    rabbit.exchange.as_str(),
                    format!("o-{round}-{i}"),
                    b"other".to_vec(),
                )
            })
            .collect();
        for id in outbox
            .enqueue_batch(&db.client, &others)
            .await
            .expect("others")
        {
            other_ids.insert(id.to_string());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let arrived = || {
        rabbit
            .deliveries()
            .iter()
            .filter(|d| other_ids.contains(&d.message_id))
            .count()
    };
    assert!(
        eventually(Duration::from_secs(30), || async {
            arrived() == other_ids.len()
        })
        .await,
        "seed {seed}: {} of {} other messages arrived",
        arrived(),
        other_ids.len()
    );
    assert!(
        !rabbit
            .deliveries()
            .iter()
            .any(|d| d.payload.starts_with(b"hot-")),
        "seed {seed}: a parked key's message overtook its dead letter"
    );
    relay.stop().await;
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// A key whose later rows were set aside until a time that came before
/// their head's: a head set aside again (its batch failed once more, or
/// with a longer hold) after its later rows had been. Once all are due, a
/// claim's scan of due rows, in order of time, takes those later rows
/// first. Each is blocked by the head, which is due and not in the claim,
/// and so was left where it was; with more of them than a batch, every
/// claim took the same rows and nothing else, and the relay stopped for
/// good. Such a row must now be set aside for a moment, behind its head.
#[tokio::test]
async fn later_rows_due_before_their_head_do_not_stop_the_claims() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    let batch_size = 50;
    let messages: Vec<Message> = (0..10 * batch_size as usize)
        .map(|i| keyed(rabbit.exchange.as_str(), "k", format!("{i}").into_bytes()))
        .collect();
    db.outbox()
        .enqueue_batch(&db.client, &messages)
        .await
        .expect("enqueue");
    let table = db.table();
    db.client
        .batch_execute(&format!(
            "UPDATE {table} SET next_attempt_at = now() - interval '1 minute' \
              WHERE seq = (SELECT min(seq) FROM {table}); \
             UPDATE {table} SET next_attempt_at = now() - interval '2 minutes' \
              WHERE seq > (SELECT min(seq) FROM {table});"
        ))
        .await
        .expect("set the rows aside");
    let relay = InProcessRelay::amqp(
        &db,
        outbox_relay::Settings {
            batch_size,
            ..fast_settings()
        },
    );
    let drained = eventually(PATIENCE, || async { db.pending().await == 0 }).await;
    let pending = db.pending().await;
    relay.stop().await;
    assert!(drained, "{pending} of {} rows never went", messages.len());
    rabbit.expect_at_least(messages.len(), PATIENCE).await;
    let order: Vec<usize> = rabbit
        .deliveries()
        .iter()
        .map(|d| {
            String::from_utf8_lossy(&d.payload)
                .parse()
                .expect("a number")
        })
        .collect();
    assert_eq!(
        order,
        (0..messages.len()).collect::<Vec<_>>(),
        "the key's messages out of order"
    );
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// A row set aside again, for longer (its retry's backoff grew, or its
/// batch waited out another outage), takes the rows of its key already set
/// aside behind it along: their times become its own. Left earlier, they
/// came due before it; the claim's scan of due rows goes in order of time,
/// so every claim took them first, each blocked, and they crowded the rows
/// of other keys out of it (after a Kafka partition's outage, a hot key's
/// backlog drained a few rows per batch, and the other keys' fresh rows
/// behind it with them). Rows of other keys, and fresh rows of the key, are
/// left as they are.
#[tokio::test]
async fn a_head_set_aside_again_keeps_its_key_behind_it() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let message = |key: &str| keyed("anywhere", key, b"x".to_vec());
    let mut messages: Vec<Message> = (0..50).map(|_| message("k")).collect();
    messages.extend((0..10).map(|_| message("other")));
    messages.extend((0..10).map(|_| message("k")));
    db.outbox()
        .enqueue_batch(&db.client, &messages)
        .await
        .expect("enqueue");
    let table = db.table();
    // The head and the other key's rows due now; the head's 49 followers
    // set aside behind it until a second from now; the key's last 10 fresh.
    db.client
        .batch_execute(&format!(
            "UPDATE {table} SET next_attempt_at = now() \
              WHERE ordering_key = 'other' OR seq = (SELECT min(seq) FROM {table}); \
             UPDATE {table} SET next_attempt_at = now() + interval '1 second' \
              WHERE ordering_key = 'k' AND seq > (SELECT min(seq) FROM {table}) \
                AND seq < (SELECT min(seq) FROM {table} WHERE ordering_key = 'other');"
        ))
        .await
        .expect("set the rows aside");
    let head: i64 = db
        .client
        .query_one(&format!("SELECT min(seq) FROM {table}"), &[])
        .await
        .expect("head")
        .get(0);
    let queries = outbox_relay::source::claim::Queries::new(&db.schema, false, false);
    // Once through an outage's hold, once through a failed attempt's backoff.
    for (name, minutes) in [("note_batch_error", 5.0), ("fail", 10.0)] {
        let secs = minutes * 60.0;
        match name {
            "note_batch_error" => queries
                .note_batch_error(
                    &db.client,
                    &[head],
                    "partition offline",
                    Some(Duration::from_secs_f64(secs)),
                )
                .await
                .expect("note"),
            _ => queries
                .fail(
                    &db.client,
                    &[(head, "refused".to_owned(), Duration::from_secs_f64(secs))],
                )
                .await
                .expect("fail"),
        };
        let rows = db
            .client
            .query(
                &format!(
                    "SELECT ordering_key, count(*) FILTER (WHERE next_attempt_at = '-infinity'), \
                            count(*) FILTER (WHERE next_attempt_at >= now() + make_interval(secs => $1) - interval '5 seconds'), \
                            count(*) \
                     FROM {table} WHERE seq <> $2 GROUP BY 1 ORDER BY 1"
                ),
                &[&secs, &head],
            )
            .await
            .expect("times");
        let counts: Vec<(String, i64, i64, i64)> = rows
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
            .collect();
        assert_eq!(
            counts,
            vec![("k".to_owned(), 10, 49, 59), ("other".to_owned(), 0, 0, 10)],
            "after {name}: (key, fresh, behind the head's new time, rows)"
        );
    }
    db.cleanup().await;
}
