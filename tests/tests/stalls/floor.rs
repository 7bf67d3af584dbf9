//! The claim floor under what breaks a queue table: a snapshot held open
//! elsewhere while rows are deleted (each claim would walk every deleted row),
//! transactions that commit late while the floor moves, and rows that come
//! back below the floor (a retried dead letter, a key waiting out a backoff,
//! a hand-written UPDATE).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use outbox_client::Message;
use outbox_relay::publish::memory::MemoryPublisher;
use outbox_relay::source::floor::{FloorAt, Tracker, PASS_AFTER};
use outbox_tests::claim::{run_claim, ClaimSession};
use outbox_tests::db::{connect, last_seq, pinned_snapshot, TestDb};
use outbox_tests::{eventually, fast_settings, InProcessRelay};
use rand::{Rng, SeedableRng};

use super::PATIENCE;

/// Long enough that no rescan happens during a test: a row the floor passed
/// by mistake would stay behind it.
const NO_RESCAN: Duration = Duration::from_secs(3600);

fn message(destination: &str, key: &str, body: String) -> Message {
    Message::builder(destination)
        .key(key)
        .payload(body.into_bytes())
        .build()
        .expect("valid")
}

/// A REPEATABLE READ snapshot held open on another connection (a report,
/// pg_dump) keeps 19,000 deleted rows from being marked dead. Without a
/// floor, the claim visits each of them; with the floor, it reads about what
/// it takes. At floor 0 (the relay before it) the claim touched 23,402
/// buffers against 1,578 from the floor.
#[tokio::test]
async fn a_pinned_snapshot_does_not_make_claims_walk_deleted_rows() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let rows: Vec<Message> = (0..20_000)
        .map(|i| message("x", &format!("k{}", i % 100), "p".repeat(1024 + i % 7)))
        .collect();
    db.enqueue_all(&rows).await;
    let pin = pinned_snapshot(&db.config).await;
    db.client
        .batch_execute(&format!(
            "DELETE FROM {t} WHERE seq IN (SELECT seq FROM {t} ORDER BY seq LIMIT 19000)",
            t = db.table()
        ))
        .await
        .expect("delete the published rows");

    let floor = outbox_tests::claim::floor(&db.client, &db.schema)
        .await
        .expect("floor");
    let first_left: i64 = db
        .client
        .query_one(&format!("SELECT min(seq) FROM {}", db.table()), &[])
        .await
        .expect("min")
        .get(0);
    assert_eq!(floor, first_left, "the floor is the oldest row left");

    let (walked, unfloored) = run_claim(&db.config, &db.schema, 0).await.expect("claim");
    let (floored_cost, floored) = run_claim(&db.config, &db.schema, floor)
        .await
        .expect("claim");
    let (walked, floored_cost) = (walked.buffers, floored_cost.buffers);
    println!(
        "claim buffers under a pinned snapshot: {walked} from seq 0, {floored_cost} from the floor"
    );
    // 19,000 deleted rows of 1 KiB fill about 2,700 heap pages; a claim that
    // walks them visits each.
    assert!(
        walked > 2_000,
        "the pinned snapshot did not keep the deleted rows visible to the scan ({walked} buffers)"
    );
    assert!(
        floored_cost * 5 < walked,
        "with the floor the claim still touched {floored_cost} buffers (without: {walked})"
    );
    assert_eq!(floored, unfloored, "the floor changed what the claim takes");
    assert_eq!(floored.len(), 500);
    pin.batch_execute("ROLLBACK").await.expect("unpin");
    db.cleanup().await;
}

/// Writers commit late while the relay drains and its floor moves: a seeded
/// mix of transactions that commit at once, hold their rows uncommitted for
/// up to 1.5 s, or roll back, under a snapshot pinned for the whole run.
/// Every committed message must go out and no rolled-back one, with no
/// rescan to rescue a row the floor passed, and the floor must have moved
/// (else the test proves nothing). Per key, a row committed before a later
/// row's transaction began to commit must go out first: the floor moves
/// past the transactions held open, and the head-of-key probe must still
/// see what they commit.
#[tokio::test]
async fn late_commits_are_never_passed_by_the_floor() {
    outbox_tests::init_logging();
    let seed = outbox_tests::seed();
    println!("seed {seed}");
    let db = TestDb::new().await;
    let pin = pinned_snapshot(&db.config).await;
    let publisher = MemoryPublisher::new();
    let settings = outbox_relay::Settings {
        batch_size: 50,
        claim_floor_rescan: Some(NO_RESCAN),
        ..fast_settings()
    };
    let relay = InProcessRelay::with(&db, publisher, settings);
    let floor = relay.floor.clone();
    let writers: Vec<_> = (0..8u64)
        .map(|w| {
            spawn_late_writer(&db, seed ^ (w + 1), w, 60, |rng| {
                format!("k{}", rng.random_range(0..20))
            })
        })
        .collect();
    let mut highest_floor = 0;
    let mut written = Vec::new();
    let mut rolled_back = HashSet::new();
    for writer in writers {
        while !writer.is_finished() {
            highest_floor = highest_floor.max(floor.get());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let (c, r) = writer.await.expect("writer");
        written.extend(c);
        rolled_back.extend(r);
    }
    let drained = eventually(PATIENCE, || async { db.pending().await == 0 }).await;
    let order = published(&relay);
    assert_went_out(&db, seed, drained, &written, &rolled_back, &order).await;
    assert!(
        highest_floor > 100,
        "seed {seed}: the floor never moved (highest {highest_floor}), so nothing was tested"
    );
    relay.stop().await;
    pin.batch_execute("ROLLBACK").await.expect("unpin");
    db.cleanup().await;
}

/// A transaction that wrote to the outbox and stays open (a long import, a
/// forgotten `BEGIN` after an insert) while 5,000 other rows drain. It holds
/// the horizon, so the rows deleted since it began stay in the index. The
/// floor used to wait at its row for as long as it ran, and every claim
/// walked those rows; now the floor moves past it. The row must still go
/// out when the transaction commits, with no rescan to find it, and so must
/// a row of another open transaction committed after the first.
#[tokio::test]
async fn a_long_writer_transaction_does_not_hold_the_floor() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let relay = without_rescan(&db);
    let mut open = Vec::new();
    let mut waiting = Vec::new();
    for name in ["first", "second"] {
        let client = connect(&db.config).await;
        client.batch_execute("BEGIN").await.expect("begin");
        let id = db
            .outbox()
            .enqueue(&client, &message("x", name, name.to_owned()))
            .await
            .expect("enqueue");
        let seq: i64 = client
            .query_one(&format!("SELECT max(seq) FROM {}", db.table()), &[])
            .await
            .expect("own row")
            .get(0);
        waiting.push((id.as_uuid(), seq));
        open.push(client);
    }
    let floor = move_floor_past(&db, &relay, 5_000).await;
    let lowest = waiting[0].1;
    assert!(
        floor > lowest,
        "the floor at {floor} did not pass the open row at {lowest}"
    );
    // The head-of-key probe still looks at every row from below the open
    // ones: once committed, they hold back their keys' later rows.
    let at = relay.floor.at();
    assert!(
        at.probe <= lowest,
        "the probe's floor at {} passed the open row at {lowest}",
        at.probe
    );
    let (from_row, _) = run_claim(&db.config, &db.schema, lowest)
        .await
        .expect("claim from the open row");
    let (from_floor, _) = run_claim(&db.config, &db.schema, at)
        .await
        .expect("claim from the floor");
    println!(
        "claim buffers with a writer open: {} from its row, {} from the floor",
        from_row.buffers, from_floor.buffers
    );
    assert!(
        from_floor.buffers * 5 < from_row.buffers,
        "from the floor the claim touched {} buffers, from the open row {}",
        from_floor.buffers,
        from_row.buffers
    );
    // Each commits, and the next row of its key follows at once, as a
    // writer waiting on the same aggregate would: the later row must not
    // go out first, in the moment before the floor comes back.
    for (((id, seq), client), name) in waiting.into_iter().zip(open).zip(["first", "second"]) {
        client.batch_execute("COMMIT").await.expect("commit");
        let next = db
            .outbox()
            .enqueue(&db.client, &message("x", name, format!("{name} again")))
            .await
            .expect("enqueue")
            .as_uuid();
        assert!(
            eventually(PATIENCE, || async {
                went_out(&relay, id) && went_out(&relay, next)
            })
            .await,
            "the row at seq {seq}, committed after the floor passed it (at {}), never went out",
            relay.floor.get()
        );
        let order: Vec<uuid::Uuid> = published(&relay)
            .into_iter()
            .filter(|m| *m == id || *m == next)
            .collect();
        assert_eq!(
            order,
            [id, next],
            "key {name:?}: its next row went out before the row committed late"
        );
    }
    relay.stop().await;
    db.cleanup().await;
}

/// A writer left open while one hot key drains: the floor moves past it,
/// and its transaction pins the horizon, so the 5,000 rows of the key
/// deleted since cannot be marked dead. While it is still in progress,
/// nothing it wrote is visible, and the head-of-key probe looks from the
/// floor; looking from where the floor was when it passed the writer (as
/// it did for as long as the writer ran), each claim walked all 5,000 for
/// the key. Once it has committed, a claim with the same floor must look
/// from there again, and hold its key's next row back behind its row.
#[tokio::test]
async fn a_writer_left_open_does_not_make_the_probe_walk_a_hot_keys_deleted_rows() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let relay = without_rescan(&db);
    let writer = connect(&db.config).await;
    writer.batch_execute("BEGIN").await.expect("begin");
    db.outbox()
        .enqueue(&writer, &message("x", "w", "w".to_owned()))
        .await
        .expect("enqueue");
    // The rows deleted are of 1 KiB, seven to a page; those the claims
    // then take are small, so that what the probe walks shows.
    let hot = |n: usize, size: usize| -> Vec<Message> {
        (0..n)
            .map(|i| message("x", "hot", format!("hot-{i}-{}", "p".repeat(size))))
            .collect()
    };
    floor_past(&db, &relay, &hot(5_000, 1024)).await;
    // The relay's own transactions hold the lock a writer holds, and on a
    // slow machine one may be passed too, for as long as it runs: what is
    // measured is the floor once the open writer alone is passed.
    let alone = || {
        let at = relay.floor.at();
        at.probe < at.scan && at.open_writers().len() == 1
    };
    let passed = eventually(PATIENCE, || async { alone() }).await;
    // Drained, the relay claims nothing more: the floor stays as it is.
    let at = relay.floor.at();
    relay.stop().await;
    assert!(
        passed && at.open_writers().len() == 1,
        "the floor did not pass the open writer alone, with its id: {at:?}"
    );
    let next = db
        .outbox()
        .enqueue(&db.client, &message("x", "w", "w again".to_owned()))
        .await
        .expect("enqueue");
    let next_seq = max_seq(&db).await;
    db.outbox()
        .enqueue_batch(&db.client, &hot(500, 0))
        .await
        .expect("enqueue");
    let from_base = FloorAt {
        open: None,
        ..at.clone()
    };
    let (walked, taken_from_base) = run_claim(&db.config, &db.schema, from_base.clone())
        .await
        .expect("claim probing from the base");
    let (open, taken) = run_claim(&db.config, &db.schema, at.clone())
        .await
        .expect("claim probing from the floor");
    println!(
        "claim buffers with a writer open: {} probing from where it was passed, {} from the floor",
        walked.buffers, open.buffers
    );
    assert_eq!(
        taken, taken_from_base,
        "where the probe looked changed what the claim takes"
    );
    // The 5,000 deleted rows of 1 KiB fill about 700 heap pages, which a
    // probe from the base visits one by one; the rest of the claim (500
    // small rows locked and read) is the same either way.
    assert!(
        walked.buffers >= open.buffers + 600,
        "with the writer in progress the claim still touched {} buffers (from its base: {})",
        open.buffers,
        walked.buffers
    );
    // Committed, the writer's row is visible below the scan, and the same
    // floor must hold its key's next row back behind it.
    writer.batch_execute("COMMIT").await.expect("commit");
    let session = ClaimSession::open(&db.config, &db.schema)
        .await
        .expect("session");
    let verdicts = session.verdicts(at).await.expect("claim");
    let verdict = verdicts.iter().find(|v| v.0 == next_seq);
    assert_eq!(
        verdict,
        Some(&(next_seq, true)),
        "key w's next row (id {next:?}) was not held back behind the row its writer committed"
    );
    db.cleanup().await;
}

/// Writers that each stay open longer than the floor waits for one, in
/// turn, so that several are always open: a batch job whose workers each
/// write an event early in a transaction of a few seconds. The floor moves
/// past each, and each row must still go out, with no rescan. The seq the
/// head-of-key probe looks from must keep up too: the floor remembers each
/// writer with the floor it had when passed, so the oldest one still open
/// sets it. Remembered together, under the first writer's floor until none
/// were left, it stayed at 0 for the whole run, and every claim's probes
/// walked each key's rows deleted since. The probe is sampled while at
/// least two writers are known to be open, so a slow run cannot pass for
/// want of open writers.
#[tokio::test]
async fn writers_open_in_turn_do_not_hold_the_probe_back() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let relay = without_rescan(&db);
    let rounds = 3;
    // Writers with a transaction open, and whether any has begun its last
    // round.
    let open = Arc::new(AtomicUsize::new(0));
    let last_round = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..6u64 {
        let config = db.config.clone();
        let outbox = db.outbox();
        let (open, last_round) = (Arc::clone(&open), Arc::clone(&last_round));
        writers.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(500 * w)).await;
            let client = connect(&config).await;
            let mut written = Vec::new();
            for r in 0..rounds {
                client.batch_execute("BEGIN").await.expect("begin");
                let id = outbox
                    .enqueue(
                        &client,
                        &message("x", &format!("w{w}"), format!("w{w}-{r}")),
                    )
                    .await
                    .expect("enqueue");
                open.fetch_add(1, Ordering::SeqCst);
                if r == rounds - 1 {
                    last_round.store(true, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_secs(3)).await;
                open.fetch_sub(1, Ordering::SeqCst);
                client.batch_execute("COMMIT").await.expect("commit");
                written.push(id.as_uuid());
            }
            written
        }));
    }
    // Rows of other keys keep the claims going meanwhile; the probe's seq
    // is sampled while two writers or more are open.
    let outbox = db.outbox();
    let mut first_top = None;
    let (mut passed, mut late_probe) = (false, None::<i64>);
    let mut i = 0;
    while !writers.iter().all(|w| w.is_finished()) {
        outbox
            .enqueue(
                &db.client,
                &message("x", &format!("other-{i}"), format!("other-{i}")),
            )
            .await
            .expect("enqueue");
        i += 1;
        let at = relay.floor.at();
        let open_now = open.load(Ordering::SeqCst);
        if open_now >= 2 {
            passed |= at.scan > at.probe;
            if first_top.is_none() {
                let top = max_seq(&db).await;
                first_top = Some(top);
            }
            if last_round.load(Ordering::SeqCst) {
                late_probe = Some(late_probe.unwrap_or(0).max(at.probe));
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut written = Vec::new();
    for w in writers {
        written.push(w.await.expect("writer"));
    }
    for &id in written.iter().flatten() {
        assert!(
            eventually(PATIENCE, || async { went_out(&relay, id) }).await,
            "a row committed after the floor passed it never went out (floor {})",
            relay.floor.get()
        );
    }
    assert!(
        passed,
        "the floor never moved past an open writer, so nothing was tested"
    );
    let top = first_top.expect("two writers were open at once");
    let late = late_probe.expect("sampled in the last round with two writers open");
    assert!(
        late > top,
        "in the last round the probe looked from {late} at most, below every row committed once two writers were open (up to {top})"
    );
    relay.stop().await;
    db.cleanup().await;
}

/// `CREATE INDEX CONCURRENTLY` on the outbox while a report runs: the build
/// waits for the report's snapshot to end, holding its
/// `ShareUpdateExclusiveLock` on the table all along, as VACUUM, ANALYZE
/// and most `ALTER TABLE ... SET` forms hold it for as long as they take.
/// None of them can insert a row (an insert takes a `RowExclusiveLock`
/// of its own), so none is a writer the floor must wait for or move past.
/// Counted as one, the build held the floor for half a second and was
/// then passed as an open writer: the head-of-key probe looked from where
/// the floor had been for as long as the build waited, walking each key's
/// rows deleted since, which the report keeps from being marked dead.
#[tokio::test]
async fn an_index_build_waiting_behind_a_report_is_not_taken_for_a_writer() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let relay = without_rescan(&db);
    let report = pinned_snapshot(&db.config).await;
    let build = connect(&db.config).await;
    let building = {
        let sql = format!("CREATE INDEX CONCURRENTLY ON {} (created_at)", db.table());
        tokio::spawn(async move { build.batch_execute(&sql).await })
    };
    let waiting = "SELECT count(*) FROM pg_stat_progress_create_index \
                   WHERE phase = 'waiting for old snapshots'";
    let build_waits = || async {
        let n: i64 = db
            .client
            .query_one(waiting, &[])
            .await
            .expect("progress")
            .get(0);
        n == 1
    };
    assert!(
        eventually(PATIENCE, build_waits).await,
        "the index build never came to wait for the report"
    );
    // Twice, the second time after the floor would have passed the build
    // as an open writer.
    move_floor_past(&db, &relay, 5_000).await;
    tokio::time::sleep(PASS_AFTER * 2).await;
    let floor = move_floor_past(&db, &relay, 1_000).await;
    let level = eventually(PATIENCE, || async {
        let at = relay.floor.at();
        at.probe == at.scan
    })
    .await;
    let at = relay.floor.at();
    assert!(build_waits().await, "the index build stopped waiting");
    assert!(
        level,
        "with the index build waiting, the probe looks from {} below the floor at {} (first past the rows at {floor})",
        at.probe, at.scan
    );
    report
        .batch_execute("ROLLBACK")
        .await
        .expect("end the report");
    building
        .await
        .expect("build task")
        .expect("the index is built");
    relay.stop().await;
    db.cleanup().await;
}

/// A committed row of the seeded late-commit scenario, and when its
/// transaction's commit began and returned.
struct Written {
    id: uuid::Uuid,
    seq: i64,
    key: String,
    /// Its transaction: writer and number.
    tx: (u64, usize),
    commit_began: Instant,
    committed: Instant,
}

/// Commits `tx`, whose rows are `rows`, and stamps them with when the
/// commit began and returned.
async fn commit_timed(tx: tokio_postgres::Transaction<'_>, mut rows: Vec<Written>) -> Vec<Written> {
    let began = Instant::now();
    tx.commit().await.expect("commit");
    let done = Instant::now();
    for r in &mut rows {
        (r.commit_began, r.committed) = (began, done);
    }
    rows
}

/// Panics unless every row in `written` went out (and the outbox was
/// `drained`), none of `rolled_back` did, and each key's rows went out in
/// order (see [`assert_key_order`]). `order` is every id the broker
/// accepted, in the order it accepted them.
async fn assert_went_out(
    db: &TestDb,
    seed: u64,
    drained: bool,
    written: &[Written],
    rolled_back: &HashSet<uuid::Uuid>,
    order: &[uuid::Uuid],
) {
    let went_out: HashSet<uuid::Uuid> = order.iter().copied().collect();
    let missing = written.iter().filter(|w| !went_out.contains(&w.id)).count();
    assert!(
        drained && missing == 0,
        "seed {seed}: {missing} committed messages never went out ({} rows left); the floor passed a late commit",
        db.pending().await
    );
    assert!(
        went_out.is_disjoint(rolled_back),
        "seed {seed}: a rolled-back message went out"
    );
    assert_key_order(seed, written, order);
}

/// Panics if a row went out, the first time, before an older row of its
/// key that had committed before its own transaction began to commit, or
/// that was written in the same transaction (whose rows commit at once,
/// and must go out in their order).
fn assert_key_order(seed: u64, written: &[Written], order: &[uuid::Uuid]) {
    let first: std::collections::HashMap<uuid::Uuid, usize> = order
        .iter()
        .enumerate()
        .rev()
        .map(|(i, id)| (*id, i))
        .collect();
    let mut inversions = Vec::new();
    for a in written {
        for b in written {
            if a.key == b.key
                && a.seq < b.seq
                && (a.tx == b.tx || a.committed < b.commit_began)
                && first[&b.id] < first[&a.id]
            {
                inversions.push((a.seq, b.seq));
            }
        }
    }
    assert!(
        inversions.is_empty(),
        "seed {seed}: {} rows went out before an older row of their key committed earlier, e.g. (older, newer) seqs {:?}",
        inversions.len(),
        &inversions[..inversions.len().min(5)]
    );
}

/// What a writer of [`spawn_late_writer`] committed, and the ids it rolled back.
type WriterResult = (Vec<Written>, Vec<uuid::Uuid>);

/// A writer of `transactions` transactions of 1-4 rows, each with a key
/// from `key`: a seeded three in ten hold their rows uncommitted for
/// 200-1,500 ms while others commit and go out, one in ten rolls back, and
/// the rest commit at once.
fn spawn_late_writer(
    db: &TestDb,
    seed: u64,
    w: u64,
    transactions: usize,
    key: impl Fn(&mut rand::rngs::StdRng) -> String + Send + 'static,
) -> tokio::task::JoinHandle<WriterResult> {
    let config = db.config.clone();
    let outbox = db.outbox();
    let own_seqs = format!(
        "SELECT message_id, seq, ordering_key FROM {} WHERE message_id = ANY($1)",
        db.table()
    );
    tokio::spawn(async move {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut client = connect(&config).await;
        let (mut committed, mut rolled_back) = (Vec::new(), Vec::new());
        for t in 0..transactions {
            let tx = client.transaction().await.expect("begin");
            let n = rng.random_range(1..=4);
            let batch: Vec<Message> = (0..n)
                .map(|i| message("x", &key(&mut rng), format!("w{w}-t{t}-{i}")))
                .collect();
            let ids = outbox.enqueue_batch(&tx, &batch).await.expect("enqueue");
            let rows: Vec<Written> = tx
                .query(
                    &own_seqs,
                    &[&ids.iter().map(|i| i.as_uuid()).collect::<Vec<_>>()],
                )
                .await
                .expect("own seqs")
                .iter()
                .map(|r| Written {
                    id: r.get(0),
                    seq: r.get(1),
                    key: r.get(2),
                    tx: (w, t),
                    commit_began: Instant::now(),
                    committed: Instant::now(),
                })
                .collect();
            match rng.random_range(0..10) {
                // Late: hold the rows uncommitted while others commit and
                // go out, then commit.
                0..=2 => {
                    tokio::time::sleep(Duration::from_millis(rng.random_range(200..1500))).await;
                    committed.extend(commit_timed(tx, rows).await);
                }
                3 => {
                    tokio::time::sleep(Duration::from_millis(rng.random_range(0..500))).await;
                    tx.rollback().await.expect("rollback");
                    rolled_back.extend(ids.iter().map(|i| i.as_uuid()));
                }
                _ => {
                    committed.extend(commit_timed(tx, rows).await);
                    tokio::time::sleep(Duration::from_millis(rng.random_range(0..40))).await;
                }
            }
        }
        (committed, rolled_back)
    })
}

/// Replicas that come and go while writers commit late, with no rescan:
/// each replica keeps a floor for the partitions it owns beside the shared
/// one, and ownership moves at every start and stop. A seeded 2-4 replicas
/// at a time, a seeded share of the rows on one hot key, under a pinned
/// snapshot. A floor kept for one set of partitions and used for another,
/// or not brought back for a late commit, leaves rows behind for good.
/// Every committed message must go out, no rolled-back one, each key's
/// rows in order (one broker, shared by the replicas, records the order
/// they went out in), and the replicas must have used floors of their own
/// (else nothing was tested).
#[tokio::test]
async fn replicas_that_come_and_go_pass_no_late_commit() {
    outbox_tests::init_logging();
    let seed = outbox_tests::seed();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let hot_share = rng.random_range(0..=60u32);
    let most = rng.random_range(2..=4usize);
    println!("seed {seed}: up to {most} replicas, {hot_share} % of the rows on one key");
    let db = TestDb::new().await;
    let pin = pinned_snapshot(&db.config).await;
    // One broker for every replica: it accepts in one order, across them.
    let broker = MemoryPublisher::new();
    let start = || {
        let settings = outbox_relay::Settings {
            batch_size: 50,
            claim_floor_rescan: Some(NO_RESCAN),
            ..fast_settings()
        };
        InProcessRelay::with(&db, broker.clone(), settings)
    };
    let mut replicas = vec![start(), start()];
    let writers: Vec<_> = (0..6u64)
        .map(|w| {
            spawn_late_writer(&db, seed ^ (w + 1), w, 60, move |rng| {
                if rng.random_range(0..100) < hot_share {
                    "hot".to_owned()
                } else {
                    format!("k{}", rng.random_range(0..40))
                }
            })
        })
        .collect();
    let (mut own_seen, mut changes) = (0, 0);
    while !writers.iter().all(|w| w.is_finished()) {
        let pause = Instant::now() + Duration::from_millis(rng.random_range(300..1200));
        while Instant::now() < pause {
            own_seen += replicas
                .iter()
                .filter(|r| r.floor.at().own.is_some())
                .count();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if replicas.len() > 1 && (replicas.len() == most || rng.random_bool(0.5)) {
            let gone = replicas.swap_remove(rng.random_range(0..replicas.len()));
            gone.stop().await;
        } else {
            replicas.push(start());
        }
        changes += 1;
    }
    let (mut written, mut rolled_back) = (Vec::new(), HashSet::new());
    for writer in writers {
        let (c, r) = writer.await.expect("writer");
        written.extend(c);
        rolled_back.extend(r);
    }
    let drained = eventually(PATIENCE, || async { db.pending().await == 0 }).await;
    for r in replicas {
        r.stop().await;
    }
    // Read once every replica has stopped: a batch in flight at a stop is
    // still published and settled.
    let order: Vec<uuid::Uuid> = broker.published().iter().map(|e| e.message_id).collect();
    assert_went_out(&db, seed, drained, &written, &rolled_back, &order).await;
    assert!(
        own_seen > 0,
        "seed {seed}: no replica ever kept a floor of its own partitions, so nothing was tested"
    );
    println!(
        "seed {seed}: {} messages, {changes} changes of replicas, floors of their own seen {own_seen} times",
        written.len()
    );
    pin.batch_execute("ROLLBACK").await.expect("unpin");
    db.cleanup().await;
}

/// The ids of the messages the relay's in-memory broker has accepted, in
/// the order it accepted them.
fn published(relay: &InProcessRelay) -> Vec<uuid::Uuid> {
    relay
        .publisher::<MemoryPublisher>()
        .published()
        .iter()
        .map(|e| e.message_id)
        .collect()
}

/// Whether the relay's in-memory broker has accepted message `id`.
fn went_out(relay: &InProcessRelay, id: uuid::Uuid) -> bool {
    published(relay).contains(&id)
}

/// A relay on the in-memory broker that never rescans from seq 0: a row
/// the floor passed by mistake would stay behind it.
fn without_rescan(db: &TestDb) -> InProcessRelay {
    with_rescan(db, NO_RESCAN)
}

/// A relay on the in-memory broker whose floor is recomputed from seq 0
/// every `rescan`.
fn with_rescan(db: &TestDb, rescan: Duration) -> InProcessRelay {
    let settings = outbox_relay::Settings {
        claim_floor_rescan: Some(rescan),
        ..fast_settings()
    };
    InProcessRelay::with(db, MemoryPublisher::new(), settings)
}

/// Drains `n` messages of other keys so the floor passes everything enqueued
/// before them, and returns the floor then.
async fn move_floor_past(db: &TestDb, relay: &InProcessRelay, n: usize) -> i64 {
    let others: Vec<Message> = (0..n)
        .map(|i| message("x", &format!("other-{i}"), format!("other-{i}")))
        .collect();
    floor_past(db, relay, &others).await
}

/// Enqueues `rows`, waits until the relay has drained them and its floor
/// is past them, and returns the floor then.
async fn floor_past(db: &TestDb, relay: &InProcessRelay, rows: &[Message]) -> i64 {
    db.outbox()
        .enqueue_batch(&db.client, rows)
        .await
        .expect("enqueue");
    let top = max_seq(db).await;
    assert!(
        eventually(PATIENCE, || async { relay.floor.get() > top }).await,
        "the floor stayed at {} below {top}",
        relay.floor.get()
    );
    relay.floor.get()
}

/// The highest seq given so far.
async fn max_seq(db: &TestDb) -> i64 {
    db.client
        .query_one(&format!("SELECT max(seq) FROM {}", db.table()), &[])
        .await
        .expect("max")
        .get(0)
}

/// A dead letter retried after the floor has passed its seq comes back due
/// at once, not fresh below the floor, where (with no rescan) the claim
/// would not look for an hour. Before retries came back due, it stayed in
/// the outbox until the test gave up.
#[tokio::test]
async fn a_dead_letter_retried_below_the_floor_goes_out() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let settings = outbox_relay::Settings {
        max_attempts: 1,
        claim_floor_rescan: Some(NO_RESCAN),
        ..fast_settings()
    };
    let relay = InProcessRelay::with(&db, MemoryPublisher::new(), settings);
    let head = db
        .outbox()
        .enqueue(&db.client, &message("x", "k", "head".into()))
        .await
        .expect("enqueue");
    relay.publisher::<MemoryPublisher>().reject(head.as_uuid());
    assert!(
        eventually(PATIENCE, || async { db.count("dead_letters").await == 1 }).await,
        "the refused message was not dead-lettered"
    );
    let floor = move_floor_past(&db, &relay, 2_000).await;
    relay.publisher::<MemoryPublisher>().accept(head.as_uuid());
    let filter = outbox_relay::ops::dead_letters::Filter {
        id: Some(head.as_uuid()),
        ..Default::default()
    };
    let moved = outbox_relay::ops::dead_letters::retry(&db.client, &db.schema, &filter)
        .await
        .expect("retry");
    assert_eq!(moved, 1);
    assert!(
        eventually(PATIENCE, || async { went_out(&relay, head.as_uuid()) }).await,
        "the retried message (below the floor at {floor}) never went out"
    );
    relay.stop().await;
    db.cleanup().await;
}

/// A key's head waits out a backoff while thousands of other messages go
/// out and the floor passes it and the rows set aside behind it. A message
/// of that key committed afterwards, above the floor, must still wait for
/// them: the head-of-key probe looks below the floor for waiting rows.
/// Without that second probe the new message went out first.
#[tokio::test]
async fn a_key_waiting_below_the_floor_still_holds_back_its_new_rows() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let settings = outbox_relay::Settings {
        max_attempts: 1_000,
        // The head stays in backoff for the whole test.
        retry_base: Duration::from_secs(3600),
        retry_max: Duration::from_secs(3600),
        claim_floor_rescan: Some(NO_RESCAN),
        ..fast_settings()
    };
    let relay = InProcessRelay::with(&db, MemoryPublisher::new(), settings);
    let outbox = db.outbox();
    let head = outbox
        .enqueue(&db.client, &message("x", "hot", "hot-0".into()))
        .await
        .expect("enqueue");
    relay.publisher::<MemoryPublisher>().reject(head.as_uuid());
    // Refused alone first, so the rows behind it are never in its batch.
    assert!(
        eventually(PATIENCE, || async {
            db.client
                .query_opt(
                    &format!(
                        "SELECT 1 FROM {} WHERE message_id = $1 AND attempts > 0",
                        db.table()
                    ),
                    &[&head.as_uuid()],
                )
                .await
                .expect("query")
                .is_some()
        })
        .await,
        "the head was never refused"
    );
    let behind: Vec<Message> = (1..=5)
        .map(|i| message("x", "hot", format!("hot-{i}")))
        .collect();
    outbox
        .enqueue_batch(&db.client, &behind)
        .await
        .expect("enqueue");
    let floor = move_floor_past(&db, &relay, 2_000).await;
    outbox
        .enqueue(&db.client, &message("x", "hot", "hot-6".into()))
        .await
        .expect("enqueue");
    // Let the relay see the new row while the head is still refused.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let hot = |relay: &InProcessRelay| -> Vec<String> {
        relay
            .publisher::<MemoryPublisher>()
            .published()
            .iter()
            .filter(|e| e.ordering_key.as_deref() == Some("hot"))
            .map(|e| String::from_utf8_lossy(&e.payload).into_owned())
            .collect()
    };
    assert!(
        hot(&relay).is_empty(),
        "messages of the blocked key went out before its head (floor {floor}): {:?}",
        hot(&relay)
    );
    // The backoff cut short for the key's rows, which were set aside until
    // the head's next attempt.
    relay.publisher::<MemoryPublisher>().accept(head.as_uuid());
    db.client
        .execute(
            &format!(
                "UPDATE {} SET next_attempt_at = now() \
                 WHERE ordering_key = 'hot' AND next_attempt_at > now()",
                db.table()
            ),
            &[],
        )
        .await
        .expect("bring the key forward");
    assert!(
        eventually(PATIENCE, || async { hot(&relay).len() == 7 }).await,
        "the hot key did not drain: {:?}",
        hot(&relay)
    );
    let expected: Vec<String> = (0..=6).map(|i| format!("hot-{i}")).collect();
    assert_eq!(hot(&relay), expected, "the hot key went out of order");
    relay.stop().await;
    db.cleanup().await;
}

/// A row put fresh below the floor by something other than the relay (here
/// a hand-written INSERT with an old seq) is found by the next rescan.
#[tokio::test]
async fn a_row_put_below_the_floor_by_hand_is_found_by_the_rescan() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let relay = with_rescan(&db, Duration::from_secs(1));
    let floor = move_floor_past(&db, &relay, 2_000).await;
    let id = uuid::Uuid::now_v7();
    db.client
        .execute(
            &format!(
                "INSERT INTO {} (seq, message_id, destination, payload) OVERRIDING SYSTEM VALUE \
                 VALUES (1, $1, 'x', 'by hand')",
                db.table()
            ),
            &[&id],
        )
        .await
        .expect("insert below the floor");
    assert!(
        eventually(PATIENCE, || async { went_out(&relay, id) }).await,
        "a row at seq 1, below the floor at {floor}, was never found"
    );
    relay.stop().await;
    db.cleanup().await;
}

/// A sequence that hands out values in blocks would let a session commit a
/// seq the floor has passed; the floor refuses it and says why.
#[tokio::test]
async fn the_floor_refuses_a_cached_sequence() {
    let db = TestDb::new().await;
    db.client
        .batch_execute(&format!(
            "ALTER TABLE {} ALTER COLUMN seq SET CACHE 20",
            db.table()
        ))
        .await
        .expect("cache the sequence");
    let mut tracker = Tracker::new(&db.schema, NO_RESCAN);
    let refused = tracker.prepare(&db.client).await.expect_err("refused");
    assert!(
        refused.to_string().contains("CACHE 1"),
        "unexpected: {refused}"
    );
    db.cleanup().await;
}

/// A sequence made to cache values while the relay runs (`ALTER ... SET
/// CACHE`, a common tuning for tables that take many inserts): each writer
/// session then takes a block of seqs and uses it over its next inserts,
/// while other sessions' blocks lie above it, so the floor passes the rest
/// of a block as soon as the session that holds it is between
/// transactions. Its next rows land below the floor. The cache was checked
/// only when the floor's session began: with no rescan, such a row stayed
/// in the outbox. The floor now reads the cache at every step and turns
/// itself off once it is not 1.
#[tokio::test]
async fn a_sequence_cached_while_the_relay_runs_turns_the_floor_off() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let relay = without_rescan(&db);
    move_floor_past(&db, &relay, 10).await;
    db.client
        .batch_execute(&format!(
            "ALTER TABLE {} ALTER COLUMN seq SET CACHE 20",
            db.table()
        ))
        .await
        .expect("cache the sequence");
    // Two writer sessions, each taking a block of 20 with its first row.
    let (a, b) = (connect(&db.config).await, connect(&db.config).await);
    let outbox = db.outbox();
    let first = outbox
        .enqueue(&a, &message("x", "a", "a-1".into()))
        .await
        .expect("enqueue on a");
    let second = outbox
        .enqueue(&b, &message("x", "b", "b-1".into()))
        .await
        .expect("enqueue on b");
    let top = max_seq(&db).await;
    // Both delivered, and the floor either past b's block or off.
    assert!(
        eventually(PATIENCE, || async {
            went_out(&relay, first.as_uuid())
                && went_out(&relay, second.as_uuid())
                && (relay.floor.get() == 0 || relay.floor.get() > top)
        })
        .await,
        "the first rows were not delivered, or the floor stayed at {}",
        relay.floor.get()
    );
    // a's next row takes the next value of its block, below b's.
    let late = outbox
        .enqueue(&a, &message("x", "a", "a-2".into()))
        .await
        .expect("enqueue on a again");
    let seq: i64 = db
        .client
        .query_one(
            &format!("SELECT seq FROM {} WHERE message_id = $1", db.table()),
            &[&late.as_uuid()],
        )
        .await
        .expect("its seq")
        .get(0);
    assert!(
        seq < top,
        "a's second row took {seq}, not a value of its block below {top}"
    );
    assert!(
        eventually(PATIENCE, || async { went_out(&relay, late.as_uuid()) }).await,
        "a row at seq {seq}, from a session's cached block, was never found (floor at {})",
        relay.floor.get()
    );
    relay.stop().await;
    db.cleanup().await;
}

/// Put back to `CACHE 1` (which makes every session drop the values it
/// had cached: checked in psql, a session's next value after the change
/// came from the sequence, not from its block), the sequence lets the
/// floor back on, asked again at the next rescan.
#[tokio::test]
async fn a_sequence_put_back_to_cache_1_turns_the_floor_back_on() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let relay = with_rescan(&db, Duration::from_secs(1));
    move_floor_past(&db, &relay, 10).await;
    let cache = |n: i64| {
        let (client, sql) = (
            &db.client,
            format!("ALTER TABLE {} ALTER COLUMN seq SET CACHE {n}", db.table()),
        );
        async move { client.batch_execute(&sql).await.expect("alter the cache") }
    };
    cache(20).await;
    let outbox = db.outbox();
    outbox
        .enqueue(&db.client, &message("x", "k", "cached".into()))
        .await
        .expect("enqueue");
    assert!(
        eventually(PATIENCE, || async { relay.floor.get() == 0 }).await,
        "the floor stayed at {} with the sequence caching 20",
        relay.floor.get()
    );
    cache(1).await;
    // Fails unless the floor moves past the rows written from now on.
    move_floor_past(&db, &relay, 10).await;
    relay.stop().await;
    db.cleanup().await;
}

/// An outbox emptied with `TRUNCATE ... RESTART IDENTITY` (a test
/// environment reset, say) while the relay runs: the sequence starts again
/// at 1, far below the floor, and every new row lands below it. No claim
/// takes a row, so no step of the floor's would run; with no rescan they
/// stayed in the outbox. The floor's session now reads the sequence about
/// once a second while claims take nothing, and starts from 0 once the
/// sequence is behind it.
#[tokio::test]
async fn a_sequence_restarted_while_the_relay_idles_does_not_strand_new_rows() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let relay = without_rescan(&db);
    let floor = move_floor_past(&db, &relay, 100).await;
    assert!(
        eventually(PATIENCE, || async { db.pending().await == 0 }).await,
        "the first rows did not drain"
    );
    db.client
        .batch_execute(&format!("TRUNCATE {} RESTART IDENTITY", db.table()))
        .await
        .expect("truncate");
    let rows: Vec<Message> = (0..5)
        .map(|i| message("x", "k", format!("after-{i}")))
        .collect();
    let ids = db
        .outbox()
        .enqueue_batch(&db.client, &rows)
        .await
        .expect("enqueue");
    let top = last_seq(&db.client, &db.table()).await;
    assert!(
        top < floor,
        "the new rows went to {top}, not below the floor at {floor}"
    );
    assert!(
        eventually(PATIENCE, || async {
            ids.iter().all(|id| went_out(&relay, id.as_uuid()))
        })
        .await,
        "rows at seqs 1-{top}, after the sequence restarted below the floor at {floor}, \
         were never found (floor now {})",
        relay.floor.get()
    );
    relay.stop().await;
    db.cleanup().await;
}

/// The same, with the outbox emptied and written again past the old floor
/// in one transaction (a reset that reloads fixtures, a script that
/// truncates and backfills): by the time the relay reads the sequence,
/// its last value is above the floor again, so a last value behind the
/// floor no longer shows the restart, and the rows below the floor
/// stayed there (for good, with no rescan; up to `--claim-floor-rescan`
/// by default). The sequence's new storage file shows it now.
#[tokio::test]
async fn a_sequence_restarted_and_written_past_the_floor_at_once_strands_nothing() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let relay = without_rescan(&db);
    let floor = move_floor_past(&db, &relay, 100).await;
    assert!(
        eventually(PATIENCE, || async { db.pending().await == 0 }).await,
        "the first rows did not drain"
    );
    let n = usize::try_from(floor).expect("floor") + 20;
    let rows: Vec<Message> = (0..n)
        .map(|i| message("x", &format!("k{}", i % 7), format!("after-{i}")))
        .collect();
    let mut client = outbox_tests::db::connect(&db.config).await;
    let tx = client.transaction().await.expect("begin");
    tx.batch_execute(&format!("TRUNCATE {} RESTART IDENTITY", db.table()))
        .await
        .expect("truncate");
    let ids = db
        .outbox()
        .enqueue_batch(&tx, &rows)
        .await
        .expect("enqueue");
    tx.commit().await.expect("commit");
    let top = last_seq(&db.client, &db.table()).await;
    assert!(
        top > floor,
        "the new rows reach {top}, not past the floor at {floor}"
    );
    assert!(
        eventually(PATIENCE, || async {
            ids.iter().all(|id| went_out(&relay, id.as_uuid()))
        })
        .await,
        "{} of {n} rows at seqs 1-{top}, written past the floor at {floor} in the \
         transaction that restarted the sequence, were never found (floor now {})",
        ids.iter()
            .filter(|id| !went_out(&relay, id.as_uuid()))
            .count(),
        relay.floor.get()
    );
    // Each key's rows went out first in the order they were written: the
    // rows below the floor were not overtaken by their keys' newer ones.
    let new: std::collections::HashSet<uuid::Uuid> = ids.iter().map(|id| id.as_uuid()).collect();
    let mut firsts: std::collections::HashMap<String, Vec<i64>> = std::collections::HashMap::new();
    let mut seen = std::collections::HashSet::new();
    for e in relay.publisher::<MemoryPublisher>().published() {
        if new.contains(&e.message_id) && seen.insert(e.message_id) {
            firsts
                .entry(e.ordering_key.clone().unwrap_or_default())
                .or_default()
                .push(e.seq);
        }
    }
    for (key, seqs) in &firsts {
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "key {key}'s rows went out of order across the restarted sequence: {seqs:?}"
        );
    }
    relay.stop().await;
    db.cleanup().await;
}

/// A prepared transaction (two-phase commit: `PREPARE TRANSACTION`, as a
/// transaction manager or an XA-speaking app does) holds its outbox rows
/// uncommitted with no session behind it, for as long as its coordinator
/// takes, and then commits them with the low seqs they got when they were
/// written, even across a crash of the server. The floor must not pass them
/// meanwhile: with no rescan, a row the floor passed would stay in the
/// outbox. Needs a server with
/// `max_prepared_transactions` above 0, so it runs on a private cluster.
#[tokio::test]
async fn a_prepared_transaction_committed_late_is_not_passed_by_the_floor() {
    outbox_tests::init_logging();
    let cluster =
        outbox_tests::cluster::PrivateCluster::start(&[("max_prepared_transactions", "4")])
            .expect("a private Postgres cluster");
    let config: tokio_postgres::Config = cluster.url().parse().expect("url");
    let mut db = TestDb::new_at(config).await;
    let settings = outbox_relay::Settings {
        batch_size: 50,
        claim_floor_rescan: Some(NO_RESCAN),
        ..fast_settings()
    };
    let relay = InProcessRelay::with(&db, MemoryPublisher::new(), settings);

    // Rows committed around it go out, and the floor has every chance to
    // move: while its transaction is still an ordinary one, and again once
    // it is prepared and no session is behind it (its locks then show in
    // `pg_locks` without a pid).
    async fn drain_others(db: &TestDb, round: usize) {
        let others: Vec<Message> = (0..300)
            .map(|i| message("x", &format!("other-{i}"), format!("other-{round}-{i}")))
            .collect();
        db.outbox()
            .enqueue_batch(&db.client, &others)
            .await
            .expect("enqueue");
        assert!(
            eventually(PATIENCE, || async { db.pending().await == 0 }).await,
            "the rows committed beside the late one did not go out (round {round})"
        );
        // Claims were taken and the floor stepped many times meanwhile.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // The late row, and its seq as its own transaction saw it.
    let writer = connect(&db.config).await;
    writer.batch_execute("BEGIN").await.expect("begin");
    let late = db
        .outbox()
        .enqueue(&writer, &message("x", "late", "prepared".to_owned()))
        .await
        .expect("enqueue")
        .as_uuid();
    let late_seq: i64 = writer
        .query_one(
            &format!("SELECT seq FROM {} WHERE message_id = $1", db.table()),
            &[&late],
        )
        .await
        .expect("seq")
        .get(0);
    drain_others(&db, 1).await;
    writer
        .batch_execute("PREPARE TRANSACTION 'outbox-late'")
        .await
        .expect("prepare transaction");
    drop(writer);
    drain_others(&db, 2).await;
    let floor = relay.floor.get();
    assert!(
        floor <= late_seq,
        "the floor moved to {floor}, past the prepared transaction's row {late_seq}"
    );
    // A crash of the server keeps the prepared transaction; the relay
    // reconnects, and its floor starts over beside it.
    cluster
        .crash_restart()
        .expect("restart the private cluster");
    db.client = connect(&db.config).await;
    drain_others(&db, 3).await;
    let floor = relay.floor.get();
    assert!(
        floor <= late_seq,
        "after the restart the floor moved to {floor}, past the prepared transaction's row {late_seq}"
    );

    db.client
        .batch_execute("COMMIT PREPARED 'outbox-late'")
        .await
        .expect("commit prepared");
    assert!(
        eventually(PATIENCE, || async { went_out(&relay, late) }).await,
        "the row committed by COMMIT PREPARED never went out (floor {}, row {late_seq}, {} rows left)",
        relay.floor.get(),
        db.pending().await
    );
    // The floor moves on once the prepared transaction is gone.
    assert!(
        eventually(PATIENCE, || async { relay.floor.get() > late_seq }).await,
        "the floor stayed at {} after the prepared transaction committed",
        relay.floor.get()
    );
    relay.stop().await;
    drop(cluster);
}

/// A replica that does not own a hot key's partition must not walk that
/// key's backlog at every poll. Another replica holds partitions 32-63 and
/// publishes nothing (a replica behind a stalled broker), with 5,000 rows
/// of one key waiting in one of them; this relay owns the other 32. The
/// fresh index is ordered by seq alone, so a scan over this relay's
/// partitions from a floor below the backlog reads every one of its
/// entries to find none of its own. Before the floor was kept for the
/// partitions a replica owns, every idle look did that: 5,000 entries
/// about five times a second, a core of Postgres at 100,000 rows for a
/// replica with nothing to do. Then the other replica leaves, and this
/// relay must take the backlog, in order, with no rescan: a floor kept for
/// 32 partitions must not be used for 64.
#[tokio::test]
async fn a_replica_does_not_walk_the_backlog_of_partitions_it_does_not_own() {
    use outbox_relay::source::ownership::LockKeys;
    const HOT: i64 = 5_000;
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let other = connect(&db.config).await;
    let keys = LockKeys::fetch(&other, &db.schema).await.expect("keys");
    other
        .execute("SELECT pg_advisory_lock($1, 7)", &[&keys.presence])
        .await
        .expect("presence");
    other
        .execute(
            "SELECT pg_advisory_lock($1, p) FROM generate_series(32, 63) AS p",
            &[&keys.partitions],
        )
        .await
        .expect("partitions");
    let key: String = db
        .client
        .query_one(
            "SELECT k FROM (SELECT 'hot-' || i AS k FROM generate_series(0, 99) AS i) s \
             WHERE ((hashtext(k) % 64) + 64) % 64 >= 32 LIMIT 1",
            &[],
        )
        .await
        .expect("a key of the other replica's")
        .get(0);
    let rows: Vec<Message> = (0..HOT)
        .map(|i| message("x", &key, format!("{i}")))
        .collect();
    db.enqueue_all(&rows).await;
    let partition: i16 = db
        .client
        .query_one(&format!("SELECT min(partition) FROM {}", db.table()), &[])
        .await
        .expect("partition")
        .get(0);
    assert!(partition >= 32, "the hot key fell in partition {partition}");

    let relay = without_rescan(&db);
    let held = |n: i64| {
        let client = &db.client;
        let partitions = keys.partitions;
        async move {
            let held: i64 = client
                .query_one(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
                     AND classid::int8 = $1::int8 AND objsubid = 2",
                    &[&i64::from(partitions)],
                )
                .await
                .expect("locks")
                .get(0);
            held == n
        }
    };
    assert!(
        eventually(PATIENCE, || held(64)).await,
        "the relay never took the other 32 partitions"
    );
    // What the relay's sessions read of the fresh index, as Postgres counts
    // it. A backend reports its counts about once a second while it works
    // (ten seconds after it last did, once idle), so the window opens after
    // the relay has settled and is long enough for many polls.
    let fresh_reads = || async {
        let n: i64 = db
            .client
            .query_one(
                "SELECT idx_tup_read FROM pg_stat_user_indexes \
                 WHERE schemaname = $1 AND indexrelname = 'messages_fresh'",
                &[&db.schema.as_str()],
            )
            .await
            .expect("index statistics")
            .get(0);
        n
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = fresh_reads().await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let read = fresh_reads().await - before;
    println!(
        "an idle replica beside {HOT} rows of another's partition read {read} entries of the fresh index in 4 s"
    );
    assert!(
        published(&relay).is_empty(),
        "the relay published rows of partitions it does not own"
    );
    // The floor's own computation walks the backlog once; its report may
    // land in the window.
    assert!(
        read < 2 * HOT,
        "an idle replica read {read} entries of the fresh index in 4 s: it walks \
         the {HOT} rows of a partition it does not own, {} times over",
        read / HOT
    );

    drop(other);
    assert!(
        eventually(PATIENCE, || async { published(&relay).len() as i64 == HOT }).await,
        "{} of the {HOT} rows went out once the other replica left",
        published(&relay).len()
    );
    let order: Vec<String> = relay
        .publisher::<MemoryPublisher>()
        .published()
        .iter()
        .map(|e| String::from_utf8_lossy(&e.payload).into_owned())
        .collect();
    let expected: Vec<String> = (0..HOT).map(|i| i.to_string()).collect();
    assert_eq!(order, expected, "the hot key's rows went out out of order");
    relay.stop().await;
    db.cleanup().await;
}
