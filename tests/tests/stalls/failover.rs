//! The Postgres server lost right after the relay settled a drain: a
//! failover to a synchronous standby, as managed "high availability"
//! Postgres and Patroni's synchronous mode do. How much comes back.

use std::collections::HashSet;
use std::time::Duration;

use outbox_client::Message;
use outbox_relay::publish::memory::MemoryPublisher;
use outbox_tests::cluster::PrivateCluster;
use outbox_tests::db::{apply_roles_sql, connect, last_seq, TestDb};
use outbox_tests::sink::Sink;
use outbox_tests::workload::{self, Spec};
use outbox_tests::{eventually, fast_settings, InProcessRelay};

use super::PATIENCE;

/// `total` messages over 97 keys, each payload `prefix-i`.
fn messages(total: usize, prefix: &str) -> Vec<Message> {
    (0..total)
        .map(|i| {
            Message::builder("x")
                .key(format!("k{}", i % 97))
                .payload(format!("{prefix}-{i}").into_bytes())
                .build()
                .expect("valid")
        })
        .collect()
}

/// The application's own table beside the outbox: one row per order,
/// named by its event's message id.
async fn orders_table(db: &TestDb) -> String {
    let orders = format!("{}.orders", db.schema.quoted());
    db.client
        .batch_execute(&format!(
            "CREATE TABLE {orders} (message_id uuid PRIMARY KEY)"
        ))
        .await
        .expect("orders table");
    orders
}

/// Commits `total` orders, each with its event, 20 to a transaction.
async fn write_orders(
    writer: &tokio_postgres::Client,
    db: &TestDb,
    orders: &str,
    prefix: &str,
    total: usize,
) {
    let outbox = db.outbox();
    for chunk in messages(total, prefix).chunks(20) {
        writer.batch_execute("BEGIN").await.expect("begin");
        let ids = outbox.enqueue_batch(writer, chunk).await.expect("enqueue");
        for id in ids {
            writer
                .execute(&format!("INSERT INTO {orders} VALUES ($1)"), &[&id.0])
                .await
                .expect("order row");
        }
        writer.batch_execute("COMMIT").await.expect("commit");
    }
}

/// The orders the server has now.
async fn kept_orders(db: &TestDb, orders: &str) -> HashSet<uuid::Uuid> {
    db.column::<uuid::Uuid>(&format!("SELECT message_id FROM {orders}"))
        .await
        .into_iter()
        .collect()
}

/// A migrated outbox with an orders table beside it, on the server at `url`
/// (a private cluster's).
async fn orders_db(url: &str) -> (TestDb, String) {
    let db = TestDb::new_at(url.parse().expect("url")).await;
    let orders = orders_table(&db).await;
    (db, orders)
}

/// What the server kept after losing commits (a failover, a crash) must
/// match what the relay published: once the relay has drained the server,
/// no event published for an order it lost, and every order it kept
/// published. `lost` says how the commits were lost.
async fn published_match_kept_orders(
    db: &TestDb,
    orders: &str,
    relay: &InProcessRelay,
    lost: &str,
) {
    let kept = kept_orders(db, orders).await;
    let drained = eventually(PATIENCE, || async { db.pending().await == 0 }).await;
    let all = relay.publisher::<MemoryPublisher>().published();
    let phantoms = all.iter().filter(|e| !kept.contains(&e.message_id)).count();
    assert_eq!(
        phantoms,
        0,
        "{phantoms} events published for orders {lost} took back ({} orders kept)",
        kept.len()
    );
    assert!(
        drained,
        "the relay did not drain after {lost}: {} rows left",
        db.pending().await
    );
    let out: HashSet<uuid::Uuid> = all.iter().map(|e| e.message_id).collect();
    assert!(
        kept.is_subset(&out),
        "{} orders the server kept after {lost} were never published",
        kept.difference(&out).count()
    );
}

/// README's bound on what one crash or outage publishes twice: the batches
/// in flight, `batch-size × (pipeline + 1)`.
fn in_flight(settings: &outbox_relay::Settings) -> usize {
    usize::try_from(settings.batch_size).expect("batch size") * (settings.pipeline + 1)
}

/// Makes the server require a synchronous standby that does not exist
/// (`on`), or no longer (`!on`). Neither statement commits anything, so
/// neither waits for it.
async fn require_a_missing_standby(db: &TestDb, on: bool) {
    let set = if on {
        "ALTER SYSTEM SET synchronous_standby_names = 'gone'"
    } else {
        "ALTER SYSTEM RESET synchronous_standby_names"
    };
    for sql in [set, "SELECT pg_reload_conf()"] {
        db.client
            .batch_execute(sql)
            .await
            .expect("change synchronous_standby_names");
    }
}

/// How many sessions named `application_name` wait for a synchronous
/// standby, as the runbook tells operators to look for them.
async fn waiting_for_the_standby(db: &TestDb, application_name: &str) -> i64 {
    db.client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE application_name = $1 AND wait_event = 'SyncRep'",
            &[&application_name],
        )
        .await
        .expect("pg_stat_activity")
        .get(0)
}

/// Once commits no longer wait, the relay drains the outbox, and `broker`
/// holds each of the `total` messages exactly once.
async fn every_message_once_the_standby_is_dropped(
    db: &TestDb,
    broker: &MemoryPublisher,
    total: usize,
) {
    assert!(
        eventually(PATIENCE, || async { db.pending().await == 0 }).await,
        "the relay did not finish once the standby was dropped: {} rows left",
        db.pending().await
    );
    let all = broker.published();
    let distinct: HashSet<_> = all.iter().map(|e| e.message_id).collect();
    assert_eq!(distinct.len(), total, "every message went out");
    assert_eq!(all.len(), total, "a message went out twice");
}

/// README's bound on duplicates: only the batches in flight when something
/// dies are published again, at most `batch-size × (pipeline + 1)`. A
/// settle the relay committed and went on from must survive the loss of
/// the server. The standby receives only WAL the primary has flushed, and
/// the primary's commits wait for the standby; a commit acknowledged
/// before its flush (`synchronous_commit = off`) is not on the standby
/// until the WAL writer's next flush, and every row settled in that window
/// comes back after the failover and is published again, however large
/// the drain. The primary's WAL writer waits 10 s between flushes (the
/// default is 200 ms, and a commit can wait up to three of those), so the
/// window is wide enough to see without a race.
///
/// Seen failing with the relay's sessions at `synchronous_commit = off`:
/// 1,950 of the 2,000 rows came back.
#[tokio::test]
async fn a_failover_after_a_drain_brings_back_at_most_the_batches_in_flight() {
    outbox_tests::init_logging();
    let primary = PrivateCluster::start(&[
        ("wal_writer_delay", "10s"),
        ("synchronous_standby_names", "*"),
    ])
    .expect("a private Postgres cluster");
    let mut standby = primary.start_standby(&[]).expect("a streaming standby");
    let config: tokio_postgres::Config = primary.url().parse().expect("url");
    let mut db = TestDb::new_at(config).await;
    let settings = outbox_relay::Settings {
        batch_size: 50,
        ..fast_settings()
    };
    let bound = in_flight(&settings);
    let relay = InProcessRelay::with(&db, MemoryPublisher::new(), settings);

    // The test's own commits wait for the flush: every row is on disk
    // before the relay can see it.
    let total = 10 * bound;
    let messages = messages(total, "failover");
    for chunk in messages.chunks(500) {
        db.outbox()
            .enqueue_batch(&db.client, chunk)
            .await
            .expect("enqueue");
    }
    let published = || relay.publisher::<MemoryPublisher>().published();
    assert!(
        eventually(PATIENCE, || async { db.pending().await == 0 }).await,
        "the drain did not finish: {} rows left",
        db.pending().await
    );
    let before = published().len();
    assert_eq!(before, total, "published before the failover");

    standby
        .take_over(primary)
        .expect("fail over to the standby");
    db.client = connect(&db.config).await;
    // What the failover brought back goes out again; give the relay time to
    // reconnect and claim before reading the table.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        eventually(PATIENCE, || async { db.pending().await == 0 }).await,
        "rows brought back by the failover did not go out: {} left",
        db.pending().await
    );
    let all = published();
    let distinct: HashSet<_> = all.iter().map(|e| e.message_id).collect();
    assert_eq!(distinct.len(), total, "every message went out");
    let again = all.len() - total;
    assert!(
        again <= bound,
        "{again} of {total} messages settled before the failover were published again, \
         above README's bound of batch-size × (pipeline + 1) = {bound}"
    );
    relay.stop().await;
    drop(standby);
}

/// A synchronous standby that is gone while the primary still names it in
/// `synchronous_standby_names`: every commit waits for it, and
/// `statement_timeout` does not end that wait. Rows committed before it
/// went missing are durable, but the relay cannot tell that from rows a
/// writer committed with `synchronous_commit = local` meanwhile: its
/// durability barrier is a commit too, and waits. So it publishes nothing
/// and settles nothing while the standby is missing (each batch goes back
/// at half the hold limit), and once the standby is no longer required
/// finishes: every row out, none twice. The relay that committed its
/// settles with `synchronous_commit = off` published all 1,000 meanwhile,
/// none of whose settles were on a standby; the relay that settled with
/// `on` but published without a barrier published 97, the batches it was
/// settling.
#[tokio::test]
async fn settles_wait_for_a_missing_synchronous_standby_and_finish_once_it_is_dropped() {
    outbox_tests::init_logging();
    let primary = PrivateCluster::start(&[]).expect("a private Postgres cluster");
    let config: tokio_postgres::Config = primary.url().parse().expect("url");
    let db = TestDb::new_at(config).await;
    let total = 1_000;
    let messages = messages(total, "standby");
    db.outbox()
        .enqueue_batch(&db.client, &messages)
        .await
        .expect("enqueue");
    // Another session holds every row, so the relay's claims come back
    // empty (they commit nothing) until it lets go.
    let holder = connect(&db.config).await;
    holder.batch_execute("BEGIN").await.expect("begin");
    holder
        .batch_execute(&format!("SELECT seq FROM {} FOR UPDATE", db.table()))
        .await
        .expect("lock every row");

    let settings = outbox_relay::Settings {
        batch_size: 50,
        ..fast_settings()
    };
    let bound = in_flight(&settings);
    let relay = InProcessRelay::with(&db, MemoryPublisher::new(), settings);
    let broker = relay.publisher::<MemoryPublisher>();
    // The relay joins, which commits, while commits still go through.
    assert!(
        eventually(PATIENCE, || async { db.count("replicas").await > 0 }).await,
        "the relay never joined"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    require_a_missing_standby(&db, true).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    // A rollback does not wait for a standby.
    holder.batch_execute("ROLLBACK").await.expect("rollback");

    // Time to claim many times over; every claim waits for its barrier.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let stuck = broker.published().len();
    assert_eq!(
        stuck, 0,
        "{stuck} published while no commit could reach the standby (the batches in flight \
         are {bound})"
    );
    assert_eq!(
        usize::try_from(db.pending().await).expect("count"),
        total,
        "a settle became visible without the standby"
    );
    // `outbox-relay status` names the cause (reading needs no standby).
    let status = outbox_relay::ops::status(&db.client, &db.schema, true)
        .await
        .expect("status");
    assert!(
        status.blockers.iter().any(|b| matches!(
            b,
            outbox_relay::ops::Blocker::CommitsWaitForStandby { waiting, .. } if *waiting >= 1
        )),
        "status does not name the missing standby: {:?}",
        status.blockers
    );
    assert_eq!(
        waiting_for_the_standby(&db, "outbox-relay-durable").await,
        1,
        "the barrier session waits for the standby"
    );

    require_a_missing_standby(&db, false).await;
    every_message_once_the_standby_is_dropped(&db, &broker, total).await;
    relay.stop().await;
    drop(primary);
}

/// A private Postgres cluster, an outbox on it, and a relay over memory
/// with `settings` that owns all 64 partitions.
async fn a_relay_owning_a_private_primary(
    settings: outbox_relay::Settings,
) -> (PrivateCluster, TestDb, InProcessRelay) {
    let primary = PrivateCluster::start(&[]).expect("a private Postgres cluster");
    let config: tokio_postgres::Config = primary.url().parse().expect("url");
    let db = TestDb::new_at(config).await;
    let relay = InProcessRelay::with(&db, MemoryPublisher::new(), settings);
    assert!(
        eventually(PATIENCE, || async {
            db.count("partition_owners").await == 64
        })
        .await,
        "the relay never took its partitions"
    );
    (primary, db, relay)
}

/// A missing synchronous standby makes commits wait on a live server, past
/// any bound the relay puts on a silent connection (`stalls stranded::`).
/// The relay must tell the two apart: a session given up while its commit
/// waits leaves its server process waiting behind it, holding a
/// connection slot, for as long as the standby stays away (Postgres does
/// not notice a client that went away meanwhile), and another one after
/// every reconnect. Here the ownership heartbeat and the durability
/// barrier wait for three hold limits: each stays one session, never
/// reopened. (A first version of the bound, which did not ask the server,
/// gave the ownership session up every 5 s: after the 13 s here, three
/// ownership sessions were there, two of them left waiting.)
#[tokio::test]
async fn a_missing_standby_makes_the_relay_give_up_no_session() {
    outbox_tests::init_logging();
    let settings = outbox_relay::Settings {
        batch_size: 50,
        hold_limit: Duration::from_secs(4),
        lease: Duration::from_secs(2),
        ..fast_settings()
    };
    let wait = settings.hold_limit * 3 + Duration::from_secs(1);
    let (primary, db, relay) = a_relay_owning_a_private_primary(settings).await;
    let broker = relay.publisher::<MemoryPublisher>();
    let outage: std::time::SystemTime = db
        .client
        .query_one("SELECT now()", &[])
        .await
        .expect("now")
        .get(0);
    require_a_missing_standby(&db, true).await;
    // Written with `local`, so the writer does not wait: the rows are
    // visible, and every claim of them waits for its barrier.
    let total = 200;
    let writer = connect(&db.config).await;
    writer
        .batch_execute("SET synchronous_commit = local")
        .await
        .expect("commit without waiting for the standby");
    db.outbox()
        .enqueue_batch(&writer, &messages(total, "standby"))
        .await
        .expect("enqueue");
    tokio::time::sleep(wait).await;

    let sessions: Vec<(String, std::time::SystemTime, Option<String>)> = db
        .client
        .query(
            "SELECT application_name, backend_start, wait_event FROM pg_stat_activity \
             WHERE application_name LIKE 'outbox-relay%' ORDER BY application_name",
            &[],
        )
        .await
        .expect("pg_stat_activity")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let named = |name: &str| sessions.iter().filter(|s| s.0 == name).count();
    assert_eq!(
        (named("outbox-relay-owner"), named("outbox-relay-durable")),
        (1, 1),
        "one ownership and one barrier session: {sessions:?}"
    );
    let waiting: Vec<&str> = sessions
        .iter()
        .filter(|s| s.2.as_deref() == Some("SyncRep"))
        .map(|s| s.0.as_str())
        .collect();
    assert!(
        waiting.contains(&"outbox-relay-durable"),
        "the barrier waits for the standby: {sessions:?}"
    );
    let reopened: Vec<&str> = sessions
        .iter()
        .filter(|s| s.1 > outage)
        .map(|s| s.0.as_str())
        .collect();
    assert!(
        reopened.is_empty(),
        "sessions given up and reopened while commits waited for the standby: {reopened:?}"
    );
    assert_eq!(
        broker.published().len(),
        0,
        "published while no commit could reach the standby"
    );

    require_a_missing_standby(&db, false).await;
    every_message_once_the_standby_is_dropped(&db, &broker, total).await;
    relay.stop().await;
    drop(primary);
}

/// SIGTERM while commits wait for a missing synchronous standby: the relay
/// still stops. Its ownership heartbeat, a commit, waits on the server with
/// every other commit; shutdown leaves it there rather than waiting with it.
/// (Before, the heartbeat held the ownership session, and the relay never
/// stopped: 120 s here.)
#[tokio::test]
async fn a_relay_stops_while_commits_wait_for_a_missing_standby() {
    outbox_tests::init_logging();
    let (primary, db, relay) = a_relay_owning_a_private_primary(outbox_relay::Settings {
        lease: Duration::from_secs(1),
        ..fast_settings()
    })
    .await;
    require_a_missing_standby(&db, true).await;
    // Heartbeats are five a lease: one soon waits for the standby.
    assert!(
        eventually(PATIENCE, || async {
            waiting_for_the_standby(&db, "outbox-relay-owner").await == 1
        })
        .await,
        "the ownership heartbeat never waited for the standby"
    );
    assert!(
        tokio::time::timeout(PATIENCE, relay.stop()).await.is_ok(),
        "the relay did not stop within {PATIENCE:?} while commits waited for the standby"
    );
    require_a_missing_standby(&db, false).await;
    drop(primary);
}

/// No loss across a failover while writers commit: four writers commit
/// 6,000 messages over 40 keys to a primary with a synchronous standby, and
/// the standby takes over halfway. Every transaction a writer saw commit
/// is delivered to RabbitMQ in key order, nothing rolled back is, and only
/// the batches in flight at the failover come twice. (A commit whose
/// connection died with the primary may or may not have happened; the
/// checker accepts either.) The writers' own commits flush the WAL all the
/// time here, taking the relay's settles to the standby with them, so the
/// relay that committed settles asynchronously passed this too (9
/// duplicates); the drain above, where only the relay commits, is the case
/// that told the two apart.
#[tokio::test]
async fn a_failover_while_writers_commit_loses_nothing() {
    outbox_tests::init_logging();
    let primary = PrivateCluster::start(&[("synchronous_standby_names", "*")])
        .expect("a private Postgres cluster");
    let mut standby = primary.start_standby(&[]).expect("a streaming standby");
    let config: tokio_postgres::Config = primary.url().parse().expect("url");
    let mut db = TestDb::new_at(config).await;
    let sink = Sink::amqp().await;
    let settings = outbox_relay::Settings {
        batch_size: 100,
        ..fast_settings()
    };
    let bound = in_flight(&settings);
    let relay = InProcessRelay::amqp(&db, settings);
    let spec = Spec {
        max_commit_delay: Duration::from_millis(10),
        ..Spec::new(sink.destination(), 4, 40, 6_000)
    };
    let writers = workload::spawn(&db, spec);
    assert!(
        eventually(PATIENCE, || async { sink.count() > 1_500 }).await,
        "the relay did not get going: {} delivered",
        sink.count()
    );
    standby
        .take_over(primary)
        .expect("fail over to the standby");
    let written = writers.await.expect("writers");
    db.client = connect(&db.config).await;
    let report = sink.settle(&db, &written, PATIENCE).await;
    println!(
        "failover while writers commit: {report} ({} indeterminate)",
        written.indeterminate.len()
    );
    assert!(report.is_clean(), "{report}");
    assert!(
        report.duplicates <= bound,
        "{} duplicates across one failover, above the {bound} of the batches in flight: {report}",
        report.duplicates
    );
    relay.stop().await;
    sink.cleanup().await;
    drop(standby);
}

/// The relay publishes a row only once the transaction that wrote it is as
/// durable as the server makes a default commit: flushed, and on the
/// synchronous standbys it names. A writer may commit with less
/// (`synchronous_commit = local` or `off`): its commit is visible at once,
/// on the primary alone, and a failover can lose it. Had the relay
/// published its row by then, consumers would act on an event whose change
/// never happened.
///
/// Here the synchronous standby stops, a writer commits order rows and
/// their events with `synchronous_commit = local`, and the standby then
/// takes over with only what it had. Every event published must belong to
/// an order the new primary has, and every order it has is published.
///
/// Seen failing with the relay that published whatever it could claim:
/// 97 of the 200 events of the orders the failover lost went out, as many
/// as its workers could claim before each one's settle waited for the
/// standby.
#[tokio::test]
async fn events_of_commits_a_failover_loses_are_never_published() {
    outbox_tests::init_logging();
    let primary = PrivateCluster::start(&[("synchronous_standby_names", "*")])
        .expect("a private Postgres cluster");
    let mut standby = primary.start_standby(&[]).expect("a streaming standby");
    let (mut db, orders) = orders_db(&primary.url()).await;
    let settings = outbox_relay::Settings {
        batch_size: 50,
        ..fast_settings()
    };
    let relay = InProcessRelay::with(&db, MemoryPublisher::new(), settings);
    let published = || relay.publisher::<MemoryPublisher>().published();

    let writer = connect(&db.config).await;

    // While the standby streams, everything goes out.
    write_orders(&writer, &db, &orders, "before", 100).await;
    assert!(
        eventually(PATIENCE, || async { published().len() >= 100 }).await,
        "the relay did not publish the first orders: {} of 100",
        published().len()
    );

    standby.stop().expect("stop the standby");
    writer
        .batch_execute("SET synchronous_commit = local")
        .await
        .expect("commit without waiting for the standby");
    write_orders(&writer, &db, &orders, "local", 200).await;
    assert_eq!(
        db.pending().await,
        200,
        "the orders committed locally are visible, their events waiting"
    );
    // Time enough to claim and publish many times over.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before_failover = published().len();

    standby
        .take_over(primary)
        .expect("fail over to the standby");
    db.client = connect(&db.config).await;
    let kept = kept_orders(&db, &orders).await;
    assert!(
        kept.len() >= 100 && kept.len() < 300,
        "the new primary has {} orders: the failover was meant to lose the local commits",
        kept.len()
    );
    tracing::info!(before_failover, "events published before the failover");
    published_match_kept_orders(&db, &orders, &relay, "the failover").await;
    relay.stop().await;
    drop(standby);
}

/// A failover to an asynchronous standby that had not received the last
/// rows, and with them the sequence's last values: the new primary gives
/// those seqs again, below the claim floor the relay computed on the old
/// one, whose value outlives the lost session. A new session of the
/// floor's computes it again from seq 0 (its first computation is a
/// rescan, whatever `--claim-floor-rescan` says), so the floor comes down
/// to the new primary's rows. This passed on the relay before the floor
/// read the sequence while idle too; it guards the floor across a failover.
#[tokio::test]
async fn a_failover_to_a_standby_behind_the_floor_strands_no_new_rows() {
    outbox_tests::init_logging();
    let primary = PrivateCluster::start(&[]).expect("a private Postgres cluster");
    let mut standby = primary.start_standby(&[]).expect("a streaming standby");
    let db = TestDb::new_at(primary.url().parse().expect("url")).await;
    let settings = outbox_relay::Settings {
        claim_floor_rescan: Some(Duration::from_secs(3600)),
        ..fast_settings()
    };
    let relay = InProcessRelay::with(&db, MemoryPublisher::new(), settings);
    let published = || relay.publisher::<MemoryPublisher>().published();
    let outbox = db.outbox();
    // Streamed to the standby.
    let client = connect(&db.config).await;
    outbox
        .enqueue_batch(&client, &messages(100, "streamed"))
        .await
        .expect("enqueue");
    assert!(
        eventually(PATIENCE, || async {
            client
                .query_one(
                    "SELECT coalesce(bool_and(replay_lsn >= pg_current_wal_lsn()), false) \
                     FROM pg_stat_replication",
                    &[],
                )
                .await
                .expect("replication state")
                .get(0)
        })
        .await,
        "the standby did not catch up"
    );
    standby.stop().expect("stop the standby");
    // Not streamed: published, and the floor moved past them.
    outbox
        .enqueue_batch(&client, &messages(300, "lost"))
        .await
        .expect("enqueue");
    let top = last_seq(&client, &db.table()).await;
    assert!(
        eventually(PATIENCE, || async {
            published().len() >= 400 && relay.floor.get() > top
        })
        .await,
        "{} of 400 published, floor at {} below {top}",
        published().len(),
        relay.floor.get()
    );
    let floor = relay.floor.get();
    drop(client);

    standby
        .take_over(primary)
        .expect("fail over to the standby");
    let client = connect(&db.config).await;
    let ids = outbox
        .enqueue_batch(&client, &messages(50, "after"))
        .await
        .expect("enqueue on the new primary");
    let highest = last_seq(&client, &db.table()).await;
    assert!(
        highest < floor,
        "the new primary gave seqs up to {highest}, not below the floor at {floor}"
    );
    let out = || {
        let out: HashSet<uuid::Uuid> = published().iter().map(|e| e.message_id).collect();
        ids.iter().filter(|id| out.contains(&id.as_uuid())).count()
    };
    assert!(
        eventually(PATIENCE, || async { out() == ids.len() }).await,
        "{} of the new primary's {} rows (seqs up to {highest}, below the floor at {floor}) \
         published; floor now {}",
        out(),
        ids.len(),
        relay.floor.get()
    );
    relay.stop().await;
    drop(standby);
}

/// Commits made with `synchronous_commit = off` are visible before their
/// WAL is written out, and a crash of the server takes them back. A claim
/// may skip the durability barrier only when it showed, by its own
/// statements, that the WAL was flushed past every commit it saw
/// (`Claimed::flushed`); otherwise the barrier's flush must come before
/// the publish.
///
/// Here every session commits without flushing (the server's own
/// `synchronous_commit = off`, as the relay's settles then do too), and the
/// WAL writer is stopped, so that nothing but the barrier flushes the WAL.
/// A writer commits orders and their events; once they are published, the
/// WAL writer is killed, which makes the server crash and recover from what
/// reached the WAL files. Every event published must belong to an order the
/// server still has. Seen failing, twice, with the claim made to report
/// every claim as flushed: 220 events were published for orders the crash
/// took back (it kept 80 of the 300).
#[tokio::test]
async fn events_of_commits_a_crash_takes_back_are_never_published() {
    outbox_tests::init_logging();
    let cluster = PrivateCluster::start(&[("synchronous_commit", "off")])
        .expect("a private Postgres cluster");
    let (mut db, orders) = orders_db(&cluster.url()).await;
    let relay = InProcessRelay::with(&db, MemoryPublisher::new(), fast_settings());
    let published = || relay.publisher::<MemoryPublisher>().published();

    let writer = connect(&db.config).await;
    write_orders(&writer, &db, &orders, "before", 100).await;
    assert!(
        eventually(PATIENCE, || async { published().len() >= 100 }).await,
        "the relay did not publish the first orders: {} of 100",
        published().len()
    );

    let walwriter: i32 = db
        .client
        .query_one(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'",
            &[],
        )
        .await
        .expect("the WAL writer's pid")
        .get(0);
    let signal = |name: &str| {
        let status = std::process::Command::new("kill")
            .args([&format!("-{name}"), &walwriter.to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill -{name} {walwriter}");
    };
    signal("STOP");
    write_orders(&writer, &db, &orders, "after", 200).await;
    let published_all = eventually(PATIENCE, || async { published().len() >= 300 }).await;
    // The crash: the postmaster resets every session and recovers.
    signal("KILL");
    let mut reconnected = None;
    for _ in 0..120 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if let Ok((client, connection)) = db.config.connect(tokio_postgres::NoTls).await {
            tokio::spawn(connection);
            if client.simple_query("SELECT 1").await.is_ok() {
                reconnected = Some(client);
                break;
            }
        }
    }
    db.client = reconnected.expect("the server did not come back after the crash");
    assert!(
        published_all,
        "{} of 300 published before the crash",
        published().len()
    );
    published_match_kept_orders(&db, &orders, &relay, "the crash").await;
    relay.stop().await;
    drop(cluster);
}

/// Aurora has been reported to refuse the WAL position functions the
/// claim reads to skip the barrier, and an administrator may revoke them. The relay must go on
/// delivering there, every batch waiting for the barrier: a claim that
/// asked for them anyway would fail every time, and nothing would go out.
/// Seen failing that way with the positions read whatever the server
/// said: 0 of 100 published.
#[tokio::test]
async fn a_role_refused_the_wal_positions_still_delivers() {
    outbox_tests::init_logging();
    let cluster = PrivateCluster::start(&[]).expect("a private Postgres cluster");
    let config: tokio_postgres::Config = cluster.url().parse().expect("url");
    let db = TestDb::new_at(config).await;
    apply_roles_sql(&cluster.url(), &db.schema).await;
    db.client
        .batch_execute(
            "CREATE ROLE walless LOGIN IN ROLE outbox_relay; \
             REVOKE EXECUTE ON FUNCTION pg_current_wal_insert_lsn(), pg_current_wal_flush_lsn() \
             FROM PUBLIC",
        )
        .await
        .expect("a role refused the WAL positions");
    let mut as_role = db.config.clone();
    as_role.user("walless");
    let refused = connect(&as_role)
        .await
        .query_one("SELECT pg_current_wal_flush_lsn()", &[])
        .await;
    assert!(
        refused.is_err(),
        "the role may still read the WAL's position"
    );

    db.outbox()
        .enqueue_batch(&db.client, &messages(100, "walless"))
        .await
        .expect("enqueue");
    let relay_db = TestDb {
        config: as_role,
        schema: db.schema.clone(),
        client: connect(&db.config).await,
    };
    let relay = InProcessRelay::with(&relay_db, MemoryPublisher::new(), fast_settings());
    let published = || relay.publisher::<MemoryPublisher>().published().len();
    let delivered = eventually(PATIENCE, || async { published() >= 100 }).await;
    let drained = eventually(PATIENCE, || async { db.pending().await == 0 }).await;
    let out = published();
    relay.stop().await;
    assert!(delivered, "{out} of 100 published");
    assert!(drained, "{} rows left", db.pending().await);
    drop(cluster);
}
