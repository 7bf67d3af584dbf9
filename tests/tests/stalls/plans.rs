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
