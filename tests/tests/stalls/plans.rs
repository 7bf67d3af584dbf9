//! The claim's plan when the planner knows nothing about the table: a table
//! never analyzed (`autovacuum = off`, or vacuum behind, or just created)
//! looks to Postgres as if almost none of its rows were fresh. The claim
//! must still read about what it takes, however large the backlog.

use outbox_client::Message;
use outbox_relay::source::claim::{ClaimLimits, Prepared, Queries};
use outbox_tests::claim::{all_partitions, ClaimSession};
use outbox_tests::db::TestDb;

async fn enqueue(db: &TestDb, from: usize, to: usize) {
    enqueue_keyed(db, from, to, "k").await
}

/// Rows `from..to` over 10,000 keys named `{prefix}{n}`.
async fn enqueue_keyed(db: &TestDb, from: usize, to: usize, prefix: &str) {
    let rows: Vec<Message> = (from..to)
        .map(|i| {
            Message::builder("x")
                .key(format!("{prefix}{}", i % 10_000))
                .payload(vec![b'p'; 1024])
                .build()
                .expect("valid")
        })
        .collect();
    db.enqueue_all(&rows).await;
}

/// Whatever the machine's autovacuum does, this table is never vacuumed or
/// analyzed by it.
async fn never_autovacuumed(db: &TestDb) {
    db.client
        .batch_execute(&format!(
            "ALTER TABLE {} SET (autovacuum_enabled = off)",
            db.table()
        ))
        .await
        .expect("alter");
}

/// The oldest fresh row's seq: the claim floor, with nothing in flight.
async fn oldest_fresh(db: &TestDb) -> i64 {
    db.client
        .query_one(
            &format!(
                "SELECT min(seq) FROM {} WHERE next_attempt_at = '-infinity'",
                db.table()
            ),
            &[],
        )
        .await
        .expect("floor")
        .get(0)
}

/// A session set up and prepared as a relay worker's, inside a transaction
/// as a worker's claim is, for calling `Queries::claim` directly.
async fn relay_transaction(
    db: &TestDb,
    queries: &Queries,
) -> (outbox_relay::source::Session, Prepared) {
    let client = outbox_relay::source::connect(
        &db.config.clone().into(),
        std::time::Duration::from_secs(60),
    )
    .await
    .expect("connect");
    let prepared = queries.prepare(&client).await.expect("prepare");
    client.batch_execute("BEGIN").await.expect("begin");
    (client, prepared)
}

/// A relay's default batch: 500 rows, 8 MiB, 60 s park recheck.
fn batch_limits() -> ClaimLimits {
    ClaimLimits {
        rows: 500,
        bytes: 8 << 20,
        park_recheck: std::time::Duration::from_secs(60),
        due_recheck: std::time::Duration::from_millis(10),
        max_payload: i64::MAX,
        max_headers: i64::MAX,
    }
}

/// With no statistics, the generic plan a relay session makes at its first
/// claim, and keeps, believed every set small. At 1,000 rows it ran the
/// head-of-key probes once per claimed row and key (250,000 index probes,
/// 1.5 million buffers, most of a second); at 50,000 it fetched every fresh
/// row with a bitmap scan and sorted them all through temporary files
/// before taking 500. A steady 1,000 msg/s stream fell minutes behind once
/// a backlog had formed.
#[tokio::test]
async fn claim_cost_stays_flat_as_the_backlog_grows_with_no_statistics() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    never_autovacuumed(&db).await;
    // The session plans its claim at a small backlog, as a relay started
    // beside a young outbox does, and keeps the plan as the backlog grows.
    enqueue(&db, 0, 1_000).await;
    let session = ClaimSession::open(&db.config, &db.schema)
        .await
        .expect("session");
    let (small, taken) = session.run(0).await.expect("claim");
    assert_eq!(taken.len(), 500, "a full batch");
    enqueue(&db, 1_000, 50_000).await;
    let (large, taken) = session.run(0).await.expect("claim");
    assert_eq!(taken.len(), 500, "a full batch");
    println!("claim at a 1,000-row backlog: {small:?}; at 50,000: {large:?}");
    for (backlog, cost) in [(1_000, small), (50_000, large)] {
        assert_eq!(
            cost.temp_written, 0,
            "the claim spilled to temporary files at a {backlog}-row backlog: {cost:?}"
        );
        // 500 rows of 1 KiB fill about 70 heap pages; the index pages and
        // one probe per key add a few per row.
        assert!(
            cost.buffers <= 20 * 500,
            "the claim read {} buffers for 500 rows at a {backlog}-row backlog",
            cost.buffers
        );
    }
    assert!(
        large.buffers <= 3 * small.buffers,
        "the claim read {} buffers at a 50,000-row backlog against {} at 1,000: its cost grows with the backlog",
        large.buffers,
        small.buffers
    );
}

/// Rows wait below the claim floor whenever a destination is paused, a
/// broker refuses a destination's messages (they wait out their retries),
/// or a key's head is stuck and its later rows are set aside. The
/// head-of-key probe looks there only through the index of waiting rows by
/// key. A session that planned its claim while nothing waited could keep a
/// plan that read every waiting row in `messages_due` for each key instead
/// (V10's index of waiting rows shares that index's predicate): with 20,000
/// rows waiting, 1.5 million buffers and 5 s per claim. Which plan won was
/// a near tie, decided by details of the statistics (here the width of the
/// keys: with keys `k0`.. the waiting index won). Migration V11's index has
/// a predicate only the probe implies.
#[tokio::test]
async fn claim_cost_stays_flat_with_rows_waiting_below_the_floor() {
    waiting_below_the_floor(Statistics::Analyzed).await;
}

/// The same, on a table never analyzed.
#[tokio::test]
async fn claim_cost_stays_flat_with_rows_waiting_below_the_floor_and_no_statistics() {
    waiting_below_the_floor(Statistics::None).await;
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Statistics {
    /// Analyzed while nothing waited, as autovacuum may leave an outbox.
    Analyzed,
    /// Never analyzed.
    None,
}

async fn waiting_below_the_floor(statistics: Statistics) {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    never_autovacuumed(&db).await;
    // Planned while nothing waits, as a relay started beside a healthy
    // outbox; the session keeps that plan.
    if statistics == Statistics::Analyzed {
        // A backlog of 50,000 when autovacuum last analyzed the table: the
        // statistics then say nothing waits, among many rows. (On the old
        // schema, at 10,000 rows or with shorter keys the plan used the
        // waiting index; this shape did not.)
        enqueue_keyed(&db, 0, 50_000, "key-").await;
        db.client
            .batch_execute(&format!("ANALYZE {}", db.table()))
            .await
            .expect("analyze");
    } else {
        enqueue(&db, 0, 1_000).await;
    }
    let session = ClaimSession::open(&db.config, &db.schema)
        .await
        .expect("session");
    let (quiet, taken) = session.run(0).await.expect("claim");
    assert_eq!(taken.len(), 500, "a full batch");
    // Then 20,000 rows of other keys wait out a retry, below the fresh rows.
    db.client
        .batch_execute(&format!("DELETE FROM {}", db.table()))
        .await
        .expect("delete");
    enqueue_keyed(&db, 0, 20_000, "w").await;
    db.client
        .batch_execute(&format!(
            "UPDATE {} SET next_attempt_at = now() + interval '1 hour'",
            db.table()
        ))
        .await
        .expect("set waiting");
    enqueue(&db, 20_000, 21_000).await;
    let floor = oldest_fresh(&db).await;
    let (waiting, taken) = session.run(floor).await.expect("claim");
    assert_eq!(taken.len(), 500, "a full batch");
    assert!(
        taken.iter().all(|&seq| seq >= floor),
        "the claim took a waiting row"
    );
    println!("{statistics:?}: claim with nothing waiting: {quiet:?}; with 20,000 rows waiting below the floor: {waiting:?}");
    assert!(
        waiting.buffers <= 20 * 500,
        "{statistics:?}: the claim read {} buffers for 500 rows with 20,000 rows waiting below the floor ({} with none)",
        waiting.buffers,
        quiet.buffers
    );
    db.cleanup().await;
}

/// The probe below the floor finds a key's waiting row, so the key's fresh
/// rows stay behind it, with V11's index and on a schema a migration behind
/// (a V10 schema during a rolling deploy: the index is not there, and the
/// probe reads the keyed index instead).
#[tokio::test]
async fn a_waiting_row_below_the_floor_holds_its_key_back_with_or_without_v11() {
    outbox_tests::init_logging();
    for v11 in [true, false] {
        let db = TestDb::new().await;
        if !v11 {
            db.client
                .batch_execute(&format!(
                    "DROP INDEX {}.messages_waiting_by_key",
                    db.schema.quoted()
                ))
                .await
                .expect("drop index");
        }
        // a1 waits out a retry; a2, a3 and b1 are fresh above it.
        for (key, wait) in [("a", true), ("a", false), ("b", false), ("a", false)] {
            db.client
                .execute(
                    &format!(
                        "INSERT INTO {} (destination, ordering_key, payload, next_attempt_at) \
                         VALUES ('x', $1, 'p', CASE WHEN $2 THEN now() + interval '1 hour' \
                                                   ELSE '-infinity' END)",
                        db.table()
                    ),
                    &[&key, &wait],
                )
                .await
                .expect("insert");
        }
        let floor = oldest_fresh(&db).await;
        let session = ClaimSession::open(&db.config, &db.schema)
            .await
            .expect("session");
        let verdicts = session.verdicts(floor).await.expect("claim");
        let first = floor - 1; // a1
        assert_eq!(
            verdicts,
            vec![(first + 1, true), (first + 2, false), (first + 3, true)],
            "with V11's index: {v11}; a's fresh rows wait behind a1, b1 goes"
        );
        db.cleanup().await;
    }
}

/// Postgres JIT-compiles a statement whose estimated cost passes
/// `jit_above_cost` (100,000 by default). The claim's generic plan passes it
/// once the table holds about a million rows, and compiling took about 42 ms
/// of every 49 ms claim: a backlog of 1,000,000 drained at half the rate of
/// one of 100,000, with the claim, which replicas take one at a time, as the
/// limit. The relay's sessions turn JIT off; the compile never pays for
/// itself in a statement that reads a few thousand buffers.
///
/// A million rows would make this test slow, so `jit_above_cost = 0` stands
/// in for them: every plan passes it, as the claim's does at 1,000,000.
#[tokio::test]
async fn the_claim_is_never_jit_compiled() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let available: bool = db
        .client
        .query_one("SELECT pg_jit_available()", &[])
        .await
        .expect("pg_jit_available")
        .get(0);
    if !available {
        // Nothing can compile here, so nothing can be checked: this server
        // was built without LLVM (or jit_provider is missing).
        println!("this Postgres has no JIT provider; nothing to check");
        return;
    }
    enqueue(&db, 0, 1_000).await;
    let mut config = db.config.clone();
    config.options("-c jit_above_cost=0");
    // The baseline: the relay's session with JIT turned back on, as it was
    // before the relay turned it off.
    let compiled = ClaimSession::open_with(&config, &db.schema, "SET jit = on")
        .await
        .expect("session")
        .run(0)
        .await
        .expect("claim")
        .0;
    assert!(
        compiled.jit_ms.is_some(),
        "with JIT on and jit_above_cost 0 the claim should compile, or this test checks nothing: {compiled:?}"
    );
    let (relay, taken) = ClaimSession::open(&config, &db.schema)
        .await
        .expect("session")
        .run(0)
        .await
        .expect("claim");
    assert_eq!(taken.len(), 500, "a full batch");
    assert_eq!(
        relay.jit_ms, None,
        "the relay's claim was JIT-compiled: {relay:?} (with JIT on: {compiled:?})"
    );
    db.cleanup().await;
}

/// A relay runs one claim at a time, and lets the next start as soon as the
/// running one's rows are locked (its `locked` callback): when the claim's
/// first statement, which only locks, has answered, while its second still
/// decides the verdicts. A claim started from that callback must then find
/// the first claim's rows all taken, and take the next ones, not some of the
/// same oldest rows.
#[tokio::test]
async fn a_claim_started_when_the_previous_one_has_locked_takes_the_next_rows() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    enqueue(&db, 0, 1_000).await; // 1,000 keys, one row each
    let queries = Queries::new(&db.schema, true, false);
    let (first, first_prepared) = relay_transaction(&db, &queries).await;
    let (second, second_prepared) = relay_transaction(&db, &queries).await;
    let limits = batch_limits();
    let partitions = all_partitions();
    let (locked_tx, locked_rx) = tokio::sync::oneshot::channel();
    let mut calls = 0;
    let (a, b) = tokio::join!(
        queries.claim(&first, &first_prepared, &limits, &partitions, 0, || {
            calls += 1;
            let _ = locked_tx.send(());
        }),
        async {
            locked_rx
                .await
                .expect("the first claim says when it has locked");
            queries
                .claim(&second, &second_prepared, &limits, &partitions, 0, || {})
                .await
        }
    );
    let seqs = |c: outbox_relay::source::claim::Claimed| -> Vec<i64> {
        assert_eq!(
            c.blocked,
            Vec::<i64>::new(),
            "every key has one row: nothing waits behind another"
        );
        c.batch.iter().map(|e| e.seq).collect()
    };
    let (a, b) = (
        seqs(a.expect("first claim")),
        seqs(b.expect("second claim")),
    );
    assert_eq!(calls, 1, "locked runs once");
    let lowest: i64 = db
        .client
        .query_one(&format!("SELECT min(seq) FROM {}", db.table()), &[])
        .await
        .expect("min")
        .get(0);
    assert_eq!(
        a,
        (lowest..lowest + 500).collect::<Vec<_>>(),
        "the first claim takes the oldest 500"
    );
    assert_eq!(
        b,
        (lowest + 500..lowest + 1_000).collect::<Vec<_>>(),
        "the second takes the next 500"
    );
    // A claim that finds nothing says so too, when its statement ends.
    let mut empty_calls = 0;
    let none = queries
        .claim(
            &first,
            &first_prepared,
            &limits,
            &partitions,
            lowest + 1_000,
            || empty_calls += 1,
        )
        .await
        .expect("empty claim");
    assert!(none.batch.is_empty());
    assert_eq!(empty_calls, 1, "locked runs for an empty claim too");
    // The open transactions hold row locks the schema's drop would wait on.
    drop((first, second));
    db.cleanup().await;
}

/// The `locked` callback must wait for the locking itself, not for the
/// statement to be sent: a claim whose locking statement is stuck (here
/// behind a table lock another session holds, as it would be behind a
/// migration's) has locked nothing, and a claim let in meanwhile could take
/// the same oldest rows. The callback may run only once the lock is gone
/// and the statement has answered.
#[tokio::test]
async fn a_claim_stuck_before_locking_does_not_let_the_next_one_start() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    enqueue(&db, 0, 100).await;
    let queries = Queries::new(&db.schema, true, false);
    let (client, prepared) = relay_transaction(&db, &queries).await;
    // Another session takes the table for itself.
    let blocker = outbox_tests::db::connect(&db.config).await;
    blocker
        .batch_execute(&format!(
            "BEGIN; LOCK TABLE {} IN ACCESS EXCLUSIVE MODE",
            db.table()
        ))
        .await
        .expect("lock the table");
    let limits = batch_limits();
    let partitions = all_partitions();
    let fired = Arc::new(AtomicBool::new(false));
    let claim = {
        let fired = Arc::clone(&fired);
        let (queries, client, prepared, limits, partitions) =
            (&queries, &client, &prepared, &limits, &partitions);
        async move {
            queries
                .claim(client, prepared, limits, partitions, 0, move || {
                    fired.store(true, Ordering::SeqCst)
                })
                .await
        }
    };
    futures::pin_mut!(claim);
    // Drive the claim until its locking statement waits on the table lock
    // (as the server shows it). It cannot finish: the table is locked.
    let waiting_sql = format!("%{}%FOR UPDATE SKIP LOCKED%", db.table());
    let waits = outbox_tests::eventually(Duration::from_secs(60), || async {
        let waiting: i64 = db
            .client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE wait_event_type = 'Lock' AND query LIKE $1",
                &[&waiting_sql],
            )
            .await
            .expect("pg_stat_activity")
            .get(0);
        waiting == 1
    });
    let waited = tokio::select! {
        _ = claim.as_mut() => panic!("a claim finished on a locked table"),
        waited = waits => waited,
    };
    assert!(
        waited,
        "the claim's locking statement never waited on the table lock"
    );
    assert!(
        !fired.load(Ordering::SeqCst),
        "the claim said its rows were locked while its locking statement was still waiting"
    );
    blocker.batch_execute("ROLLBACK").await.expect("unlock");
    let claimed = claim.await.expect("claim");
    assert_eq!(
        claimed.batch.len(),
        100,
        "every row, once the table is free"
    );
    assert!(
        fired.load(Ordering::SeqCst),
        "locked ran once the rows were"
    );
    client.batch_execute("ROLLBACK").await.expect("rollback");
    db.cleanup().await;
}

/// A claim beside the relay's other batches passes over the rows they hold
/// by seq instead of trying each one's lock (README, and the comment on the
/// claim's `lock` statement): it must take exactly what a claim that tries
/// the locks takes, tell `locked` what it locked, and a seq listed after
/// its row was released must cost that row one claim, not more.
#[tokio::test]
async fn a_claim_beside_held_rows_takes_what_trying_their_locks_would() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    enqueue(&db, 0, 1_500).await;
    let queries = Queries::new(&db.schema, true, false);
    let (first, first_prepared) = relay_transaction(&db, &queries).await;
    let (second, second_prepared) = relay_transaction(&db, &queries).await;
    let (third, third_prepared) = relay_transaction(&db, &queries).await;
    let limits = batch_limits();
    let partitions = all_partitions();
    let seqs = |c: outbox_relay::source::claim::Claimed| -> Vec<i64> {
        c.batch.iter().map(|e| e.seq).collect()
    };
    // The first batch holds the oldest 500.
    let mut held = Vec::new();
    let a = queries
        .claim_beside(&first, &first_prepared, &limits, &partitions, 0, &[], |s| {
            held = s
        })
        .await
        .expect("first claim");
    let a = seqs(a);
    assert_eq!(held, a, "locked is told the rows the claim locked");
    // Beside it, listed: the next 500, as a claim trying the locks takes.
    let b = queries
        .claim_beside(
            &second,
            &second_prepared,
            &limits,
            &partitions,
            0,
            &held,
            |_| {},
        )
        .await
        .expect("second claim");
    second.batch_execute("ROLLBACK").await.expect("rollback");
    second.batch_execute("BEGIN").await.expect("begin");
    let tried = queries
        .claim(&second, &second_prepared, &limits, &partitions, 0, || {})
        .await
        .expect("claim trying the locks");
    second.batch_execute("ROLLBACK").await.expect("rollback");
    let (b, tried) = (seqs(b), seqs(tried));
    assert_eq!(
        b, tried,
        "passing over the held rows took other rows than trying their locks"
    );
    assert_eq!(
        b.first(),
        Some(&(a[a.len() - 1] + 1)),
        "the next rows after the held ones"
    );
    // The first batch ends, its rows released unpublished, while they are
    // still listed: that claim passes over them, the next one takes them.
    first.batch_execute("ROLLBACK").await.expect("rollback");
    let stale = queries
        .claim_beside(
            &third,
            &third_prepared,
            &limits,
            &partitions,
            0,
            &held,
            |_| {},
        )
        .await
        .expect("claim with a stale list");
    assert!(
        !seqs(stale).iter().any(|s| held.contains(s)),
        "rows listed as held were taken"
    );
    third.batch_execute("ROLLBACK").await.expect("rollback");
    third.batch_execute("BEGIN").await.expect("begin");
    let again = queries
        .claim_beside(
            &third,
            &third_prepared,
            &limits,
            &partitions,
            0,
            &[],
            |_| {},
        )
        .await
        .expect("claim once the list is gone");
    assert_eq!(
        seqs(again),
        a,
        "the released rows are taken once no longer listed"
    );
    drop((first, second, third));
    db.cleanup().await;
}
