//! The claim's verdicts (which kept rows go, which are blocked and until
//! when they are set aside) are worked out by the relay from what its probes
//! return. Before, one SQL statement worked them out in Postgres. That
//! statement is kept here as the reference, and on seeded random outboxes
//! the relay's verdicts must agree with it row for row: keys skewed onto a
//! few hot ones, rows without keys, rows waiting out retries above and below
//! the floor, rows due again, rows locked by another transaction, dead
//! letters, paused destinations, and row and byte limits that cut batches
//! short.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use outbox_relay::source::claim::{ClaimLimits, Queries, HEADER_BYTES};
use outbox_tests::db::TestDb;
use rand::{Rng, SeedableRng};

/// The verdicts as one statement, as the relay ran them before: locks with
/// `lock`, then decides with `verdicts`. Parking on.
fn reference(table: &str, dead_letters: &str, paused: &str) -> (String, String) {
    let lock = format!(
        "WITH fresh AS ( \
            SELECT seq FROM {table} \
            WHERE next_attempt_at = '-infinity' AND partition = ANY($2::smallint[]) AND seq >= $3 \
            ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED \
         ), due AS ( \
            SELECT seq FROM {table} \
            WHERE next_attempt_at > '-infinity' AND next_attempt_at <= now() \
              AND partition = ANY($2::smallint[]) \
            ORDER BY next_attempt_at, seq LIMIT $1 FOR UPDATE SKIP LOCKED \
         ) \
         SELECT set_config('outbox.claimed', coalesce(array_agg(c.seq), '{{}}')::text, true) \
         FROM (SELECT seq FROM fresh UNION ALL SELECT seq FROM due) c"
    );
    let verdicts = format!(
        "WITH locked AS ( \
            SELECT seq, destination, ordering_key, \
                   (octet_length(payload) + {HEADER_BYTES})::int AS size FROM {table} \
            WHERE seq = ANY(current_setting('outbox.claimed')::bigint[]) \
         ), cand AS ( \
            SELECT c.*, row_number() OVER w AS n, sum(c.size) OVER w - c.size AS before, \
                   c.destination IN (SELECT destination FROM {paused}) AS paused \
            FROM locked c WINDOW w AS (ORDER BY c.seq) \
         ), kept AS ( \
            SELECT * FROM cand WHERE n <= $1 AND (n = 1 OR before + size <= $2) \
         ), keyed AS ( \
            SELECT c.*, max(c.seq) OVER k AS top, \
                   min(c.seq) FILTER (WHERE c.paused) OVER k AS key_paused_from \
            FROM kept c WINDOW k AS (PARTITION BY c.ordering_key) \
         ), probed AS ( \
            SELECT m.*, b.seq AS gap1, b.next_attempt_at AS gap_until1, \
                   CASE WHEN m.ordering_key IS NOT NULL AND m.seq = m.top \
                        THEN (SELECT min(d.seq) FROM {dead_letters} d WHERE d.ordering_key = m.ordering_key) \
                   END AS parked1 \
            FROM keyed m LEFT JOIN LATERAL ( \
                SELECT o.seq, o.next_attempt_at FROM ( \
                    (SELECT p.seq, p.next_attempt_at FROM {table} p \
                     WHERE p.ordering_key = m.ordering_key AND p.seq >= $4 AND p.seq < m.top \
                       AND p.seq NOT IN (SELECT seq FROM kept) ORDER BY p.seq LIMIT 1) \
                    UNION ALL \
                    (SELECT p.seq, p.next_attempt_at FROM {table} p \
                     WHERE p.ordering_key = m.ordering_key AND p.seq < least($4, m.top) \
                       AND p.next_attempt_at <> '-infinity' \
                       AND p.seq NOT IN (SELECT seq FROM kept) ORDER BY p.seq LIMIT 1)) o \
                WHERE m.ordering_key IS NOT NULL AND m.seq = m.top \
                ORDER BY o.seq LIMIT 1) b ON true \
         ), gated AS ( \
            SELECT p.*, CASE WHEN p.ordering_key IS NOT NULL THEN p.key_paused_from END AS paused_from, \
                   max(p.gap1) OVER k AS gap, max(p.gap_until1) OVER k AS gap_until, \
                   max(p.parked1) OVER k AS parked_from \
            FROM probed p WINDOW k AS (PARTITION BY p.ordering_key) \
         ) \
         SELECT g.seq, \
                g.paused OR coalesce(g.paused_from <= g.seq, false) \
                  OR coalesce(g.gap < g.seq, false) OR coalesce(g.parked_from < g.seq, false) AS blocked, \
                CASE WHEN g.paused OR g.paused_from <= g.seq OR g.parked_from < g.seq \
                       THEN greatest(now() + make_interval(secs => $3), g.gap_until) \
                     WHEN g.gap < g.seq AND g.gap_until > now() THEN g.gap_until \
                END AS hold_until \
         FROM gated g ORDER BY g.seq"
    );
    (lock, verdicts)
}

/// A verdict: blocked or not, and until when a blocked row is set aside.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Verdict {
    blocked: bool,
    hold: Option<SystemTime>,
}

/// Two holds agree when both are absent, or both are set within `slack`
/// of each other: a hold timed from `now()` moves with the transaction's
/// start, and the two claims run in two transactions.
fn holds_agree(a: Option<SystemTime>, b: Option<SystemTime>, slack: Duration) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => {
            let d = a.duration_since(b).or_else(|_| b.duration_since(a));
            d.map(|d| d <= slack).unwrap_or(false)
        }
        _ => false,
    }
}

#[tokio::test]
async fn the_relays_verdicts_agree_with_the_single_statement_they_replace() {
    outbox_tests::init_logging();
    let seed = outbox_tests::seed();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let db = TestDb::new().await;
    let table = db.table();
    let schema = db.schema.quoted();
    let (dead_letters, paused) = (
        format!("{schema}.dead_letters"),
        format!("{schema}.paused_destinations"),
    );
    let (lock_sql, verdicts_sql) = reference(&table, &dead_letters, &paused);
    let queries = Queries::new(&db.schema, true, false);
    let partitions = outbox_tests::claim::all_partitions();
    let mut compared = (0usize, 0usize, 0usize);
    for scenario in 0..60 {
        db.client
            .batch_execute(&format!("TRUNCATE {table}, {dead_letters}, {paused}"))
            .await
            .expect("truncate");
        // The mix: how many rows, how many keys (few keys: hot ones), how
        // many rows without a key, which destinations are paused.
        let rows = rng.random_range(1..300);
        let keys = rng.random_range(1..40);
        for i in 0..rows {
            let key = if rng.random_bool(0.1) {
                None
            } else {
                // Skewed: key 0 takes about a third.
                let k = if rng.random_bool(0.3) {
                    0
                } else {
                    rng.random_range(0..keys)
                };
                Some(format!("k{k}"))
            };
            let destination = format!("d{}", rng.random_range(0..3));
            let size: i32 = rng.random_range(0..2_000);
            // Most rows fresh; some waiting out a retry, some due again.
            // The oldest third waits more often, as an outbox's old rows do,
            // so that rows wait below the floor.
            let odds = if i < rows / 3 { 4 } else { 10 };
            let wait: Option<f64> = match rng.random_range(0..odds) {
                0 => Some(rng.random_range(1.0..3_600.0)),
                1 => Some(-rng.random_range(1.0..60.0)),
                _ => None,
            };
            db.client
                .execute(
                    &format!(
                        "INSERT INTO {table} (destination, ordering_key, payload, next_attempt_at) \
                         VALUES ($1, $2, convert_to(repeat('x', $3), 'UTF8'), \
                                 CASE WHEN $4::float8 IS NULL THEN '-infinity' \
                                      ELSE now() + make_interval(secs => $4::float8) END)"
                    ),
                    &[&destination, &key, &size, &wait],
                )
                .await
                .unwrap_or_else(|e| panic!("insert row {i}: {e}"));
        }
        // Some rows go to the dead letters, some destinations are paused.
        let seqs: Vec<i64> = db
            .client
            .query(&format!("SELECT seq FROM {table} ORDER BY seq"), &[])
            .await
            .expect("seqs")
            .iter()
            .map(|r| r.get(0))
            .collect();
        let dead: Vec<(i64, String)> = seqs
            .iter()
            .filter(|_| rng.random_bool(0.03))
            .map(|&s| (s, "refused".to_owned()))
            .collect();
        {
            let tx = outbox_tests::db::connect(&db.config).await;
            tx.batch_execute("BEGIN").await.expect("begin");
            queries.dead_letter(&tx, &dead).await.expect("dead letter");
            tx.batch_execute("COMMIT").await.expect("commit");
        }
        for d in 0..3 {
            if rng.random_bool(0.2) {
                db.client
                    .execute(
                        &format!("INSERT INTO {paused} (destination) VALUES ($1)"),
                        &[&format!("d{d}")],
                    )
                    .await
                    .expect("pause");
            }
        }
        // Another transaction holds some rows, as a batch in flight would.
        let other = outbox_tests::db::connect(&db.config).await;
        other.batch_execute("BEGIN").await.expect("begin");
        let in_flight: Vec<i64> = seqs
            .iter()
            .copied()
            .filter(|s| !dead.iter().any(|d| d.0 == *s) && rng.random_bool(0.1))
            .collect();
        other
            .execute(
                &format!("SELECT seq FROM {table} WHERE seq = ANY($1) FOR UPDATE"),
                &[&in_flight],
            )
            .await
            .expect("lock rows");
        // A floor no fresh row is below: none, the oldest fresh row, or
        // anywhere between.
        let oldest_fresh: Option<i64> = db
            .client
            .query_one(
                &format!("SELECT min(seq) FROM {table} WHERE next_attempt_at = '-infinity'"),
                &[],
            )
            .await
            .expect("oldest fresh")
            .get(0);
        let top = oldest_fresh.unwrap_or_else(|| seqs.last().copied().unwrap_or(0) + 1);
        let floor = match rng.random_range(0..3) {
            0 => 0,
            1 => top,
            _ => rng.random_range(0..=top),
        };
        let limits = ClaimLimits {
            rows: rng.random_range(1..200),
            bytes: rng.random_range(1..100_000),
            park_recheck: Duration::from_secs(rng.random_range(1..600)),
            due_recheck: Duration::from_millis(10),
            max_payload: i64::MAX,
            max_headers: i64::MAX,
        };

        // The reference, in a transaction of its own, rolled back.
        let session =
            outbox_relay::source::connect(&db.config.clone().into(), Duration::from_secs(60))
                .await
                .expect("connect");
        session
            .batch_execute("BEGIN ISOLATION LEVEL READ COMMITTED")
            .await
            .expect("begin");
        session
            .query_one(lock_sql.as_str(), &[&limits.rows, &partitions, &floor])
            .await
            .expect("reference lock");
        let expected: BTreeMap<i64, Verdict> = session
            .query(
                verdicts_sql.as_str(),
                &[
                    &limits.rows,
                    &limits.bytes,
                    &limits.park_recheck.as_secs_f64(),
                    &floor,
                ],
            )
            .await
            .expect("reference verdicts")
            .iter()
            .map(|r| {
                (
                    r.get::<_, i64>("seq"),
                    Verdict {
                        blocked: r.get("blocked"),
                        hold: r.get("hold_until"),
                    },
                )
            })
            .collect();
        session.batch_execute("ROLLBACK").await.expect("rollback");

        // The relay's claim, the same way.
        let prepared = queries.prepare(&session).await.expect("prepare");
        session
            .batch_execute("BEGIN ISOLATION LEVEL READ COMMITTED")
            .await
            .expect("begin");
        let claimed = queries
            .claim(&session, &prepared, &limits, &partitions, floor, || {})
            .await
            .expect("claim");
        session.batch_execute("ROLLBACK").await.expect("rollback");
        let mut actual: BTreeMap<i64, Verdict> = BTreeMap::new();
        for e in &claimed.batch {
            actual.insert(
                e.seq,
                Verdict {
                    blocked: false,
                    hold: None,
                },
            );
        }
        for &seq in &claimed.blocked {
            actual.insert(
                seq,
                Verdict {
                    blocked: true,
                    hold: None,
                },
            );
        }
        for &(seq, until) in &claimed.holds {
            actual.get_mut(&seq).expect("a hold on a blocked row").hold = Some(until);
        }
        other.batch_execute("ROLLBACK").await.expect("release");

        let context = format!(
            "scenario {scenario} (OUTBOX_TEST_SEED={seed}): {rows} rows over {keys} keys, \
             floor {floor}, {limits:?}, {} dead, {} in flight",
            dead.len(),
            in_flight.len()
        );
        assert_eq!(
            actual.keys().collect::<Vec<_>>(),
            expected.keys().collect::<Vec<_>>(),
            "the claim kept other rows than the reference: {context}"
        );
        for (seq, want) in &expected {
            let got = actual[seq];
            assert_eq!(
                got.blocked, want.blocked,
                "row {seq}: blocked {} against the reference's {}: {context}",
                got.blocked, want.blocked
            );
            assert!(
                holds_agree(got.hold, want.hold, Duration::from_secs(5)),
                "row {seq}: held until {:?} against the reference's {:?}: {context}",
                got.hold,
                want.hold
            );
        }
        compared.0 += expected.len();
        compared.1 += expected.values().filter(|v| v.blocked).count();
        compared.2 += expected.values().filter(|v| v.hold.is_some()).count();
    }
    println!(
        "{} verdicts compared, {} of them blocked, {} with a hold",
        compared.0, compared.1, compared.2
    );
    // The mix must have reached the cases that differ: rows that go, rows
    // held back, and holds.
    assert!(
        compared.0 > compared.1 && compared.1 > 0 && compared.2 > 0,
        "the scenarios never reached blocked rows and holds: {compared:?}"
    );
    db.cleanup().await;
}

/// The claim keeps the oldest locked rows within the row and byte limits:
/// one row always, and nothing younger past a row that does not fit. The
/// relay's own rule (`Heads::keep`) has a unit test; this one runs it
/// through the real claim, payloads read back included.
#[tokio::test]
async fn a_claim_keeps_the_oldest_rows_that_fit_and_one_row_always() {
    outbox_tests::init_logging();
    let db = TestDb::new().await;
    let table = db.table();
    let queries = Queries::new(&db.schema, true, false);
    let partitions = outbox_tests::claim::all_partitions();
    let session = outbox_relay::source::connect(&db.config.clone().into(), Duration::from_secs(60))
        .await
        .expect("connect");
    let prepared = queries.prepare(&session).await.expect("prepare");
    let kept = |rows: i64, bytes: i64| {
        let (queries, session, prepared, partitions) = (&queries, &session, &prepared, &partitions);
        async move {
            let limits = ClaimLimits {
                rows,
                bytes,
                park_recheck: Duration::from_secs(60),
                due_recheck: Duration::from_millis(10),
                max_payload: i64::MAX,
                max_headers: i64::MAX,
            };
            session
                .batch_execute("BEGIN ISOLATION LEVEL READ COMMITTED")
                .await
                .expect("begin");
            let claimed = queries
                .claim(session, prepared, &limits, partitions, 0, || {})
                .await
                .expect("claim");
            session.batch_execute("ROLLBACK").await.expect("rollback");
            assert!(claimed.blocked.is_empty(), "no row is blocked here");
            claimed
                .batch
                .iter()
                .map(|e| (e.seq, e.payload.len()))
                .collect::<Vec<_>>()
        }
    };
    // Three rows of 10 bytes, each of its own key, then 100 bytes, then 1.
    for (i, size) in [10, 10, 10, 100, 1].into_iter().enumerate() {
        db.client
            .execute(
                &format!(
                    "INSERT INTO {table} (destination, ordering_key, payload) \
                     VALUES ('d', $1, convert_to(repeat('x', $2), 'UTF8'))"
                ),
                &[&format!("k{i}"), &size],
            )
            .await
            .expect("insert");
    }
    let seqs: Vec<i64> = db
        .column(&format!("SELECT seq FROM {table} ORDER BY seq"))
        .await;
    let first = |n: usize| -> Vec<(i64, usize)> {
        seqs.iter()
            .copied()
            .zip([10, 10, 10, 100, 1])
            .take(n)
            .collect()
    };
    assert_eq!(kept(2, 1_000).await, first(2), "the row limit");
    assert_eq!(kept(10, 20).await, first(2), "the byte limit");
    assert_eq!(kept(10, 5).await, first(1), "one row always goes");
    assert_eq!(
        kept(10, 50).await,
        first(3),
        "a row that does not fit stops the batch: nothing younger goes past it"
    );
    assert_eq!(kept(10, 1_000).await, first(5), "everything fits");
    db.cleanup().await;
}
