//! The idempotency core API on raw connections, against a real Postgres:
//! `begin` on a key another transaction holds, a waiter when the holder rolls
//! back, a crashed process, a commit without a stored response, handler errors
//! from `run`, expiry and batched cleanup, scopes, and the cap on a huge TTL.

use std::time::Duration;

use outbox_client::idempotency::{
    Begin, Fingerprint, Idempotency, IdempotencyKey, Reply, RunError, StoredResponse,
    WhenInProgress,
};
use outbox_tests::db::{connect, TestDb, NEVER_EQUAL_TEXT};
use outbox_tests::eventually;
use outbox_tests::idempotency::SCOPE;

/// Ceiling on any wait; a healthy run needs a small fraction of it.
const PATIENCE: Duration = Duration::from_secs(60);

fn fp(body: &str) -> Fingerprint {
    Fingerprint::new("POST", "/effects", body.as_bytes())
}

fn key(k: &str) -> IdempotencyKey {
    IdempotencyKey::new(k).expect("valid key")
}

async fn effects_table(db: &TestDb) -> String {
    let t = format!("{}.effects", db.schema.quoted());
    db.client
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS {t} (id bigint GENERATED ALWAYS AS IDENTITY, note text)"
        ))
        .await
        .expect("create");
    t
}

async fn count(db: &TestDb, table: &str) -> i64 {
    db.client
        .query_one(&format!("SELECT count(*) FROM {table}"), &[])
        .await
        .expect("count")
        .get(0)
}

/// Runs a request that writes one effect row and answers 201 with `body`.
/// The notes of every effect committed to `table`.
async fn notes(db: &TestDb, table: &str) -> Vec<String> {
    db.client
        .query(&format!("SELECT note FROM {table}"), &[])
        .await
        .expect("select")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

async fn run_once(
    idempotency: &Idempotency,
    client: &mut tokio_postgres::Client,
    table: &str,
    k: &IdempotencyKey,
    body: &str,
) -> Reply {
    let table = table.to_owned();
    let body = body.to_owned();
    idempotency
        .run(client, SCOPE, k, &fp(&body), move |tx| {
            Box::pin(async move {
                tx.execute(&format!("INSERT INTO {table} (note) VALUES ($1)"), &[&body])
                    .await?;
                Ok::<_, tokio_postgres::Error>(StoredResponse::new(
                    201,
                    vec![("content-type".into(), b"text/plain".to_vec())],
                    body.into_bytes(),
                ))
            })
        })
        .await
        .expect("run")
}

#[tokio::test]
async fn concurrent_begin_never_blocks_and_never_double_applies() {
    let db = TestDb::new().await;
    let table = effects_table(&db).await;
    let idempotency = Idempotency::with_schema(db.schema.clone());
    let k = key("k1");
    let mut a = connect(&db.config).await;
    let mut b = connect(&db.config).await;

    let tx_a = a.transaction().await.expect("begin a");
    let Begin::New(pending) = idempotency
        .begin(&tx_a, SCOPE, &k, &fp("x"))
        .await
        .expect("begin")
    else {
        panic!("first begin is not New");
    };
    tx_a.execute(&format!("INSERT INTO {table} (note) VALUES ('a')"), &[])
        .await
        .expect("effect");

    // A holds the key uncommitted; B must answer at once, not queue behind A's
    // row. The ceiling only turns a hang into a failure.
    let tx_b = b.transaction().await.expect("begin b");
    let answer = tokio::time::timeout(PATIENCE, idempotency.begin(&tx_b, SCOPE, &k, &fp("x")))
        .await
        .expect("begin on an in-progress key must not block")
        .expect("begin");
    assert!(
        matches!(answer, Begin::InProgress { retry_after } if retry_after == Duration::from_secs(1)),
        "{answer:?}"
    );
    // B's transaction is still usable: InProgress wrote nothing and broke nothing.
    tx_b.execute("SELECT 1", &[]).await.expect("tx b usable");
    tx_b.rollback().await.expect("rollback b");

    idempotency
        .complete(
            &tx_a,
            pending,
            &StoredResponse::new(201, vec![], b"a".to_vec()),
        )
        .await
        .expect("complete");
    tx_a.commit().await.expect("commit a");

    let outcome = run_once(&idempotency, &mut b, &table, &k, "x").await;
    assert_eq!(
        outcome,
        Reply::Replayed(StoredResponse::new(201, vec![], b"a".to_vec()))
    );
    assert_eq!(count(&db, &table).await, 1);
    db.cleanup().await;
}

#[tokio::test]
async fn waiter_runs_the_request_when_the_holder_rolls_back() {
    let db = TestDb::new().await;
    let table = effects_table(&db).await;
    let waiting = Idempotency::with_schema(db.schema.clone())
        .when_in_progress(WhenInProgress::Wait(PATIENCE));
    let k = key("k2");
    let mut a = connect(&db.config).await;
    let mut b = connect(&db.config).await;

    let tx_a = a.transaction().await.expect("begin a");
    let begun = waiting
        .begin(&tx_a, SCOPE, &k, &fp("x"))
        .await
        .expect("begin");
    assert!(matches!(begun, Begin::New(_)));
    tx_a.execute(&format!("INSERT INTO {table} (note) VALUES ('a')"), &[])
        .await
        .expect("effect");

    let b_pid: i32 = b
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0);
    let waiter = {
        let waiting = waiting.clone();
        let table = table.clone();
        let k = k.clone();
        tokio::spawn(async move { run_once(&waiting, &mut b, &table, &k, "x").await })
    };
    // The waiter has tried the key and found it held (its last statement is
    // the try, and A still holds the key): what follows is the wait, not a
    // first try that A's rollback beat.
    assert!(
        eventually(PATIENCE, || async {
            db.client
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity \
                     WHERE pid = $1 AND query LIKE '%pg_try_advisory_xact_lock%'",
                    &[&b_pid],
                )
                .await
                .expect("pg_stat_activity")
                .get::<_, i64>(0)
                == 1
                // (Or it gave up on the key, for the outcome to tell.)
                || waiter.is_finished()
        })
        .await,
        "the waiter never tried the key"
    );
    // A crash mid-handler: A's transaction ends without completing.
    tx_a.rollback().await.expect("rollback a");
    let outcome = tokio::time::timeout(PATIENCE, waiter)
        .await
        .expect("waiter finished within the ceiling")
        .expect("join");
    assert!(matches!(outcome, Reply::Executed(_)), "{outcome:?}");
    let notes = notes(&db, &table).await;
    assert_eq!(notes, ["x"], "only the waiter's effect committed");
    db.cleanup().await;
}

/// `Wait(Duration::MAX)`, the usual way to say "as long as it takes":
/// before, adding it to the clock overflowed and every `begin` panicked,
/// with or without another request running the key.
#[tokio::test]
async fn a_wait_without_limit_waits_instead_of_panicking() {
    let db = TestDb::new().await;
    let table = effects_table(&db).await;
    let waiting = Idempotency::with_schema(db.schema.clone())
        .when_in_progress(WhenInProgress::Wait(Duration::MAX));
    let k = key("k-max");
    let mut a = connect(&db.config).await;
    let mut b = connect(&db.config).await;
    let tx_a = a.transaction().await.expect("begin a");
    let begun = waiting
        .begin(&tx_a, SCOPE, &k, &fp("x"))
        .await
        .expect("begin");
    assert!(matches!(begun, Begin::New(_)));
    let waiter = {
        let (waiting, table, k) = (waiting.clone(), table.clone(), k.clone());
        tokio::spawn(async move { run_once(&waiting, &mut b, &table, &k, "x").await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiter.is_finished(),
        "the waiter did not wait for the holder"
    );
    tx_a.rollback().await.expect("rollback a");
    let outcome = tokio::time::timeout(PATIENCE, waiter)
        .await
        .expect("waiter finished once the holder ended")
        .expect("join");
    assert!(matches!(outcome, Reply::Executed(_)), "{outcome:?}");
    db.cleanup().await;
}

#[tokio::test]
async fn a_crashed_process_leaves_no_stuck_key() {
    let db = TestDb::new().await;
    let table = effects_table(&db).await;
    let idempotency = Idempotency::with_schema(db.schema.clone());
    let k = key("k3");
    let (mut crashing, connection) = db
        .config
        .connect(tokio_postgres::NoTls)
        .await
        .expect("connect");
    let connection = tokio::spawn(connection);

    let tx = crashing.transaction().await.expect("begin");
    assert!(matches!(
        idempotency
            .begin(&tx, SCOPE, &k, &fp("x"))
            .await
            .expect("begin"),
        Begin::New(_)
    ));
    tx.execute(&format!("INSERT INTO {table} (note) VALUES ('lost')"), &[])
        .await
        .expect("effect");
    std::mem::forget(tx); // no ROLLBACK from the client: the process "dies"
                          // The socket closes as a dying process's would; the server rolls back.
    connection.abort();
    drop(crashing);

    let mut other = connect(&db.config).await;
    let waiting = idempotency
        .clone()
        .when_in_progress(WhenInProgress::Wait(PATIENCE));
    let outcome = run_once(&waiting, &mut other, &table, &k, "x").await;
    assert!(matches!(outcome, Reply::Executed(_)), "{outcome:?}");
    let notes = notes(&db, &table).await;
    assert_eq!(notes, ["x"]);
    db.cleanup().await;
}

#[tokio::test]
async fn commit_without_a_stored_response_is_refused() {
    let mut db = TestDb::new().await;
    let table = effects_table(&db).await;
    let idempotency = Idempotency::with_schema(db.schema.clone());
    let k = key("k4");

    let tx = db.client.transaction().await.expect("begin");
    let begun = idempotency
        .begin(&tx, SCOPE, &k, &fp("x"))
        .await
        .expect("begin");
    assert!(matches!(begun, Begin::New(_)));
    tx.execute(&format!("INSERT INTO {table} (note) VALUES ('x')"), &[])
        .await
        .expect("effect");
    let refused = tx.commit().await.expect_err("commit must be refused");
    assert!(
        refused
            .as_db_error()
            .is_some_and(|e| e.message().contains("without a stored response")),
        "{refused:?}"
    );
    assert_eq!(count(&db, &table).await, 0, "the effect did not commit");

    let mut other = connect(&db.config).await;
    let outcome = run_once(&idempotency, &mut other, &table, &k, "x").await;
    assert!(matches!(outcome, Reply::Executed(_)), "{outcome:?}");
    assert_eq!(count(&db, &table).await, 1);
    db.cleanup().await;
}

/// The commit-time guard holds for a caller whose path puts a look-alike
/// `=` for text ahead of pg_catalog (Postgres lets a path override built-ins
/// that way): an `in_progress` key written by plain SQL, from any language,
/// still cannot commit.
#[tokio::test]
async fn commit_without_a_stored_response_is_refused_whatever_the_callers_path() {
    let db = TestDb::new().await;
    let s = db.schema.quoted();
    let decoy = db
        .create_decoy(&format!(
            "CREATE TABLE {{decoy}}.idempotency_keys \
               (LIKE {s}.idempotency_keys INCLUDING DEFAULTS); \
             {NEVER_EQUAL_TEXT}"
        ))
        .await;
    let refused = db
        .client
        .batch_execute(&format!(
            "SET search_path = {decoy}, pg_catalog; \
             BEGIN; \
             INSERT INTO {s}.idempotency_keys (scope, key, fingerprint, state, expires_at) \
               VALUES ('{SCOPE}', 'k5', pg_catalog.decode(pg_catalog.repeat('ab', 32), 'hex'), \
                       'in_progress', pg_catalog.now() OPERATOR(pg_catalog.+) '1 hour'); \
             COMMIT"
        ))
        .await
        .expect_err("commit must be refused");
    assert!(
        refused
            .as_db_error()
            .is_some_and(|e| e.message().contains("without a stored response")),
        "{refused:?}"
    );
    db.client
        .batch_execute("ROLLBACK; RESET search_path")
        .await
        .expect("reset");
    assert_eq!(
        count(&db, &format!("{s}.idempotency_keys")).await,
        0,
        "no in_progress key committed"
    );
    db.drop_empty_decoy(&decoy, "idempotency_keys").await;
    db.cleanup().await;
}

#[derive(Debug)]
struct Insufficient;

impl std::fmt::Display for Insufficient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("insufficient funds")
    }
}

impl std::error::Error for Insufficient {}

impl From<tokio_postgres::Error> for Insufficient {
    fn from(e: tokio_postgres::Error) -> Self {
        panic!("unexpected database error: {e}")
    }
}

#[tokio::test]
async fn handler_error_from_run_is_returned_and_rolled_back() {
    let mut db = TestDb::new().await;
    let table = effects_table(&db).await;
    let idempotency = Idempotency::with_schema(db.schema.clone());
    let k = key("k5");
    let t = table.clone();
    let result = idempotency
        .run(&mut db.client, SCOPE, &k, &fp("x"), move |tx| {
            Box::pin(async move {
                tx.execute(&format!("INSERT INTO {t} (note) VALUES ('x')"), &[])
                    .await?;
                // A failure after a successful write, with the transaction
                // still healthy: nothing but run() decides it must not commit.
                Err::<StoredResponse, _>(Insufficient)
            })
        })
        .await;
    assert!(
        matches!(result, Err(RunError::Handler(Insufficient))),
        "{result:?}"
    );
    assert_eq!(count(&db, &table).await, 0);
    let outcome = run_once(&idempotency, &mut db.client, &table, &k, "x").await;
    assert!(matches!(outcome, Reply::Executed(_)), "{outcome:?}");
    assert_eq!(count(&db, &table).await, 1);
    db.cleanup().await;
}

#[tokio::test]
async fn expired_keys_run_again_and_cleanup_deletes_them_in_batches() {
    let mut db = TestDb::new().await;
    let table = effects_table(&db).await;
    let idempotency = Idempotency::with_schema(db.schema.clone()).ttl(Duration::from_secs(90));
    let records = format!("{}.idempotency_keys", db.schema.quoted());

    for i in 0..25 {
        let outcome = run_once(
            &idempotency,
            &mut db.client,
            &table,
            &key(&format!("e{i}")),
            "x",
        )
        .await;
        assert!(matches!(outcome, Reply::Executed(_)));
    }
    let ttl: Vec<bool> = db
        .column(&format!(
            "SELECT expires_at - created_at = interval '90 seconds' FROM {records}"
        ))
        .await;
    assert_eq!(ttl, vec![true; 25], "expiry is created_at + ttl");

    // Before expiry a reuse replays.
    let replay = run_once(&idempotency, &mut db.client, &table, &key("e0"), "x").await;
    assert!(matches!(replay, Reply::Replayed(_)), "{replay:?}");
    assert_eq!(count(&db, &table).await, 25);

    // Time passes for e0..e19 (moving the clock is not something a test can do).
    db.client
        .execute(
            &format!(
                "UPDATE {records} SET expires_at = now() - interval '1 second' \
                 WHERE key ~ '^e([0-9]|1[0-9])$'"
            ),
            &[],
        )
        .await
        .expect("expire");

    // An expired key reused before cleanup has run: it runs again.
    let again = run_once(&idempotency, &mut db.client, &table, &key("e0"), "x").await;
    assert!(matches!(again, Reply::Executed(_)), "{again:?}");
    assert_eq!(count(&db, &table).await, 26);
    // ... and counts as fresh: a new window, replayed from now on.
    let replay = run_once(&idempotency, &mut db.client, &table, &key("e0"), "x").await;
    assert!(matches!(replay, Reply::Replayed(_)), "{replay:?}");

    // 19 expired records left; batches of 7.
    let mut batches = Vec::new();
    loop {
        let deleted = idempotency.cleanup(&db.client, 7).await.expect("cleanup");
        batches.push(deleted);
        if deleted < 7 {
            break;
        }
    }
    assert_eq!(batches, [7, 7, 5]);
    let left: Vec<String> = db
        .client
        .query(&format!("SELECT key FROM {records} ORDER BY key"), &[])
        .await
        .expect("select")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(left, ["e0", "e20", "e21", "e22", "e23", "e24"]);

    // A cleaned-up key runs again too.
    let cleaned = run_once(&idempotency, &mut db.client, &table, &key("e5"), "x").await;
    assert!(matches!(cleaned, Reply::Executed(_)), "{cleaned:?}");
    assert_eq!(count(&db, &table).await, 27);
    db.cleanup().await;
}

#[tokio::test]
async fn scopes_keep_equal_keys_apart() {
    let mut db = TestDb::new().await;
    let table = effects_table(&db).await;
    let idempotency = Idempotency::with_schema(db.schema.clone());
    let k = key("same");
    for scope in ["user:1 POST /effects", "user:2 POST /effects"] {
        let t = table.clone();
        let outcome = idempotency
            .run(&mut db.client, scope, &k, &fp("x"), move |tx| {
                Box::pin(async move {
                    tx.execute(&format!("INSERT INTO {t} (note) VALUES ('x')"), &[])
                        .await?;
                    Ok::<_, tokio_postgres::Error>(StoredResponse::new(201, vec![], vec![]))
                })
            })
            .await
            .expect("run");
        assert!(
            matches!(outcome, Reply::Executed(_)),
            "{scope}: {outcome:?}"
        );
    }
    assert_eq!(count(&db, &table).await, 2);
    db.cleanup().await;
}

#[tokio::test]
async fn a_huge_ttl_is_capped_rather_than_overflowing_the_timestamp() {
    let mut db = TestDb::new().await;
    let table = effects_table(&db).await;
    let idempotency = Idempotency::with_schema(db.schema.clone()).ttl(Duration::MAX);
    let outcome = run_once(&idempotency, &mut db.client, &table, &key("forever"), "x").await;
    assert!(matches!(outcome, Reply::Executed(_)), "{outcome:?}");
    let years: f64 = db
        .client
        .query_one(
            &format!(
                "SELECT extract(epoch FROM expires_at - created_at)::float8 / (365.25 * 86400) \
                 FROM {}.idempotency_keys",
                db.schema.quoted()
            ),
            &[],
        )
        .await
        .expect("select")
        .get(0);
    assert!((99.0..=101.0).contains(&years), "{years} years");
    db.cleanup().await;
}

/// A scope is the caller's to build, often from a request's path, and the
/// table indexes it with the key: a btree entry holds at most 2,704 bytes of
/// keys that do not compress. A scope of 3,000 bytes came back as a bare
/// "database error" that aborted the caller's transaction. Scopes of up to
/// 1,024 bytes are taken; a longer one, or one with a NUL character, is
/// refused by name before any SQL, and the transaction goes on.
#[tokio::test]
async fn a_scope_the_table_cannot_hold_is_refused_by_name_before_any_sql() {
    let mut db = TestDb::new().await;
    let idempotency = Idempotency::with_schema(db.schema.clone());
    let tx = db.client.transaction().await.expect("begin");
    let k = key("k");
    for (scope, expected) in [
        (
            outbox_tests::random_hex(3_000),
            "idempotency scope of 3000 bytes exceeds the limit of 1024 bytes",
        ),
        (
            "user:1\0 POST /effects".to_owned(),
            "idempotency scope contains a NUL character",
        ),
    ] {
        let err = idempotency
            .begin(&tx, &scope, &k, &fp("x"))
            .await
            .expect_err("refused");
        assert!(err.is_invalid_input(), "{err:?}");
        assert_eq!(err.to_string(), expected);
    }
    let at = outbox_tests::random_hex(1_024);
    let begun = idempotency
        .begin(&tx, &at, &k, &fp("x"))
        .await
        .expect("a scope at the limit, after the refusals");
    assert!(matches!(begun, Begin::New(_)), "{begun:?}");
    tx.rollback().await.expect("rollback");
    db.cleanup().await;
}
