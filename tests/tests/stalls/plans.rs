//! The claim's plan when the planner knows nothing about the table: a table
//! never analyzed (`autovacuum = off`, or vacuum behind, or just created)
//! looks to Postgres as if almost none of its rows were fresh. The claim
//! must still read about what it takes, however large the backlog.

use outbox_client::Message;
use outbox_tests::claim::ClaimSession;
use outbox_tests::db::TestDb;

async fn enqueue(db: &TestDb, from: usize, to: usize) {
    let rows: Vec<Message> = (from..to)
        .map(|i| {
            Message::builder("x")
                .key(format!("k{}", i % 10_000))
                .payload(vec![b'p'; 1024])
                .build()
                .expect("valid")
        })
        .collect();
    for chunk in rows.chunks(1000) {
        db.outbox()
            .enqueue_batch(&db.client, chunk)
            .await
            .expect("enqueue");
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
    // Whatever the machine's autovacuum does, this table is never analyzed.
    db.client
        .batch_execute(&format!(
            "ALTER TABLE {} SET (autovacuum_enabled = off)",
            db.table()
        ))
        .await
        .expect("alter");
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
