//! An idle relay polls an empty outbox. After a claim that found nothing,
//! each poll is a look outside any transaction, and a claim follows only
//! when the look sees a row. A claim that finds nothing after all is ended
//! without waiting for the server's answer, and it must still end at once:
//! a transaction left open between polls keeps the locks of whatever rows
//! its claim touched, shows to operators as a session idle in transaction,
//! and is ended, with its session, by the hold limit.

use std::collections::HashMap;
use std::time::Duration;

use outbox_client::Message;
use outbox_tests::amqp::Fixture;
use outbox_tests::claim::ClaimSession;
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

/// An idle poll looks, outside any transaction, whether a claim would find
/// anything (`Queries::ready`): it must see what the claim's scans would
/// take, or an idle relay would leave rows waiting until something else
/// made it claim; and pass over what the relay's own batches hold, or a
/// worker standing by beside them would claim in vain at every poll. It
/// must lock nothing: a row lock gives the statement a transaction id,
/// and its commit then waits for the WAL flush and any synchronous standby
/// (`failover::a_missing_standby_makes_the_relay_give_up_no_session` found
/// idle workers waiting there). On a server that takes no writes it must
/// fail as the claim does, so that a relay left on a demoted primary
/// reconnects instead of finding nothing there for good.
#[tokio::test]
async fn a_look_sees_what_a_claim_would_take_and_locks_nothing() {
    let db = TestDb::new().await;
    let session = ClaimSession::open(&db.config, &db.schema)
        .await
        .expect("session");
    let all = outbox_tests::claim::all_partitions();
    let look = |partitions: Vec<i16>, floor: i64, mine: Vec<i64>| {
        let session = &session;
        async move {
            session
                .ready(&partitions, floor, &mine)
                .await
                .expect("look")
        }
    };
    let table = db.table();

    assert!(
        !look(all.clone(), 0, vec![]).await,
        "an empty outbox looked ready"
    );

    let m = Message::builder("orders")
        .key("k")
        .payload(b"x".to_vec())
        .build()
        .expect("valid");
    db.outbox().enqueue(&db.client, &m).await.expect("enqueue");
    let row = db
        .client
        .query_one(&format!("SELECT seq, partition FROM {table}"), &[])
        .await
        .expect("row");
    let (seq, partition): (i64, i16) = (row.get(0), row.get(1));
    assert!(
        look(all.clone(), 0, vec![]).await,
        "a fresh row was not seen"
    );
    assert!(
        look(vec![partition], seq, vec![]).await,
        "a fresh row at the floor was not seen"
    );
    assert!(
        !look(all.clone(), seq + 1, vec![]).await,
        "a row below the floor was seen: the claim's fresh scan starts at the floor"
    );
    let others: Vec<i16> = all.iter().copied().filter(|p| *p != partition).collect();
    assert!(
        !look(others, 0, vec![]).await,
        "a row of a partition this replica does not own was seen"
    );
    assert!(
        !look(all.clone(), 0, vec![seq]).await,
        "a row the relay's own batch holds was seen"
    );

    // The look locks nothing, so it takes no transaction id: asked inside a
    // transaction, it leaves that transaction without one.
    let client = session.client();
    client.batch_execute("BEGIN").await.expect("begin");
    assert!(look(all.clone(), 0, vec![]).await);
    let xid: Option<i64> = client
        .query_one("SELECT txid_current_if_assigned()", &[])
        .await
        .expect("xid")
        .get(0);
    client.batch_execute("ROLLBACK").await.expect("rollback");
    assert_eq!(
        xid, None,
        "the look took a transaction id: its commit would wait for the WAL flush and the standbys"
    );

    // Waiting out a retry: not seen until its time comes, then seen even
    // below the floor (the due scan has no floor), but not when the
    // relay's own batch holds it.
    let due_in = |interval: &'static str| {
        let (client, table) = (&db.client, &table);
        async move {
            client
                .execute(
                    &format!("UPDATE {table} SET next_attempt_at = now() + interval '{interval}'"),
                    &[],
                )
                .await
                .expect("set the row's time");
        }
    };
    due_in("1 hour").await;
    assert!(
        !look(all.clone(), 0, vec![]).await,
        "a row waiting out a retry was seen"
    );
    due_in("-1 second").await;
    assert!(
        look(all.clone(), seq + 1, vec![]).await,
        "a due row was not seen"
    );
    assert!(
        !look(all.clone(), seq + 1, vec![seq]).await,
        "a due row the relay's own batch holds was seen"
    );

    // And the claim that follows takes it.
    let claimed = session.verdicts(seq + 1).await.expect("claim");
    assert_eq!(
        claimed,
        vec![(seq, false)],
        "the claim after a look did not take the row"
    );

    session
        .set("SET default_transaction_read_only = on")
        .await
        .expect("set");
    let refused = session
        .ready(&all, 0, &[])
        .await
        .expect_err("a look on a server that takes no writes succeeded");
    assert_eq!(
        refused.code(),
        Some(&tokio_postgres::error::SqlState::READ_ONLY_SQL_TRANSACTION),
        "{refused}"
    );
    db.cleanup().await;
}
