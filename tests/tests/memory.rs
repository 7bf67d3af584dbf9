//! The relay's memory is bounded by bytes, not rows: a backlog of large
//! messages drains under a real memory cap (a cgroup, as a container limit
//! is enforced) with no restart, and the same backlog without the byte budget
//! gets the relay OOM-killed, which is what crash-looped the sidecar before.

use std::time::Duration;

use outbox_client::Message;
use outbox_tests::amqp::Fixture;
use outbox_tests::cgroup::MemoryCap;
use outbox_tests::db::TestDb;
use outbox_tests::eventually;
use outbox_tests::process::RelayProcess;

const RELAY_BIN: &str = env!("CARGO_BIN_EXE_outbox-relay-under-test");
const CAP: u64 = 128 * 1024 * 1024;
const MESSAGES: usize = 300;
const PAYLOAD: usize = 900_000;

async fn backlog(db: &TestDb, exchange: &str) {
    let outbox = db.outbox();
    for chunk in 0..MESSAGES / 20 {
        let msgs: Vec<Message> = (0..20)
            .map(|i| {
                Message::builder(exchange)
                    .key(format!("k{}", (chunk * 20 + i) % 13))
                    .payload(vec![b'a' + (i % 26) as u8; PAYLOAD])
                    .build()
                    .expect("valid")
            })
            .collect();
        outbox
            .enqueue_batch(&db.client, &msgs)
            .await
            .expect("enqueue");
    }
}

fn relay(db: &TestDb, extra: &[(&str, String)]) -> RelayProcess {
    let mut env = vec![("OUTBOX_SCHEMA", db.schema.to_string())];
    env.extend(extra.iter().cloned());
    RelayProcess::start(RELAY_BIN, &env)
}

#[tokio::test]
async fn large_messages_drain_under_a_memory_cap_and_would_not_without_the_byte_budget() {
    outbox_tests::init_logging();
    let rabbit = Fixture::new().await;

    // With the defaults: everything goes out, the process never dies.
    let db = TestDb::new().await;
    backlog(&db, &rabbit.exchange).await;
    let cap = MemoryCap::new(CAP).expect("a memory cgroup for the relay");
    let mut process = relay(&db, &[]);
    cap.add(process.pid()).expect("cap the relay");
    let drained = eventually(Duration::from_secs(180), || async {
        db.pending().await == 0
    })
    .await;
    let peak = cap.peak_bytes().unwrap_or(0);
    println!(
        "byte budget on: peak {} MiB under a {} MiB cap, {} OOM kills",
        peak >> 20,
        CAP >> 20,
        cap.oom_kills()
    );
    assert_eq!(cap.oom_kills(), 0, "the relay was OOM-killed under the cap");
    assert!(
        process.exited().is_none(),
        "the relay died: {:?}",
        process.exited()
    );
    assert!(drained, "{} rows left", db.pending().await);
    assert!(
        eventually(Duration::from_secs(60), || async {
            rabbit.count() >= MESSAGES
        })
        .await,
        "{} of {MESSAGES} delivered",
        rabbit.count()
    );
    process.kill9().await;
    drop(cap);
    db.cleanup().await;

    // The same backlog with a budget too large to bind (one batch is then
    // 500 rows x 900 KB): the cap kills the relay, as it did every restart
    // of the sidecar before the byte budget existed.
    let db = TestDb::new().await;
    backlog(&db, &rabbit.exchange).await;
    let cap = MemoryCap::new(CAP).expect("a memory cgroup for the relay");
    let mut process = relay(&db, &[("OUTBOX_BATCH_MAX_BYTES", "4GiB".to_owned())]);
    cap.add(process.pid()).expect("cap the relay");
    let killed = eventually(Duration::from_secs(120), || async { cap.oom_kills() > 0 }).await;
    assert!(
        killed,
        "without the byte budget the relay should not fit in {} MiB (peak {} MiB)",
        CAP >> 20,
        cap.peak_bytes().unwrap_or(0) >> 20
    );
    let mut exited = process.exited();
    for _ in 0..100 {
        if exited.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        exited = process.exited();
    }
    assert!(exited.is_some(), "the OOM-killed relay is still running");
    drop(cap);
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// One row larger than the broker takes, written by plain SQL (no client
/// limit on that path): 150 MB against RabbitMQ's 128 MiB. The relay knows
/// each row's size before it reads the row; reading this one would take
/// more than the relay's container has, and an OOM-killed relay meets the
/// same row at every restart, so nothing behind it would ever go. It must
/// go to the dead letters unread, the rows behind it (its own key's after
/// it, with `--dead-letter-order skip`) delivered, under the cap.
#[tokio::test]
async fn a_row_larger_than_the_broker_takes_is_dead_lettered_unread() {
    huge_row_is_dead_lettered_unread(
        150_000_000,
        "'{}'",
        "decode(repeat('ab', $2), 'hex')",
        "150000000",
    )
    .await;
}

/// The same with the bulk in the headers column: a payload of one byte,
/// and one header 100 MB long (a trace context gone wrong, a payload put in
/// a header by a hand-written writer). Postgres compresses it to about
/// 1 MB on disk, so only the value the server decompresses says how much
/// the relay would hold. It is under RabbitMQ's message limit, but headers
/// must fit in one frame (128 KiB), and the header frame's check comes
/// after the read, too late: judged against the message limit, the row was
/// read whole and the relay OOM-killed.
#[tokio::test]
async fn a_row_whose_headers_are_larger_than_the_broker_takes_is_dead_lettered_unread() {
    // The name's 5 bytes and the value's.
    huge_row_is_dead_lettered_unread(
        100_000_000,
        "jsonb_build_object('trace', repeat('a', $2))",
        "'x'",
        "headers of about 100000005 bytes exceed the connection's frame size",
    )
    .await;
}

/// Inserts one row of `huge` bytes with `headers` and `payload` (SQL of
/// `$2`, the size), then 200 rows behind it, and checks that the relay under the memory cap
/// dead-letters that row unread, with a reason that contains `named`, and
/// delivers the others.
async fn huge_row_is_dead_lettered_unread(huge: i32, headers: &str, payload: &str, named: &str) {
    outbox_tests::init_logging();
    let rabbit = Fixture::new().await;
    let db = TestDb::new().await;
    db.client
        .execute(
            &format!(
                "INSERT INTO {} (destination, ordering_key, headers, payload) \
                 VALUES ($1, 'k0', {headers}, {payload})",
                db.table()
            ),
            &[&rabbit.exchange, &huge],
        )
        .await
        .expect("insert the huge row");
    let behind: Vec<Message> = outbox_tests::workload::json_over_keys(&rabbit.exchange, 200, 5);
    db.outbox()
        .enqueue_batch(&db.client, &behind)
        .await
        .expect("enqueue");
    let cap = MemoryCap::new(CAP).expect("a memory cgroup for the relay");
    let mut process = relay(&db, &[("OUTBOX_DEAD_LETTER_ORDER", "skip".to_owned())]);
    cap.add(process.pid()).expect("cap the relay");
    let drained = eventually(Duration::from_secs(120), || async {
        db.pending().await == 0
    })
    .await;
    let peak = cap.peak_bytes().unwrap_or(0);
    let kills = cap.oom_kills();
    let dead: Vec<String> = db
        .column(&format!(
            "SELECT last_error FROM {}.dead_letters",
            db.schema.quoted()
        ))
        .await;
    let exited = process.exited();
    process.kill9().await;
    drop(cap);
    println!(
        "peak {} MiB under a {} MiB cap, {kills} OOM kills; dead letters: {dead:?}",
        peak >> 20,
        CAP >> 20
    );
    assert_eq!(kills, 0, "the relay was OOM-killed reading the huge row");
    assert!(exited.is_none(), "the relay died: {exited:?}");
    assert!(drained, "{} rows left", db.pending().await);
    assert!(
        dead.len() == 1 && dead[0].contains(named),
        "the huge row is not the one dead letter, naming its size: {dead:?}"
    );
    assert!(
        eventually(Duration::from_secs(60), || async { rabbit.count() >= 200 }).await,
        "{} of 200 delivered",
        rabbit.count()
    );
    rabbit.cleanup().await;
    db.cleanup().await;
}
