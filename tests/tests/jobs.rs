//! Jobs that must not run twice, against a real Postgres: the cron lock
//! (`job_lock`) across processes started at once, and released by a job that
//! panics or is cancelled; and a checkpointed job SIGKILLed mid-run and
//! restarted until done, applying each row once.

use std::process::Stdio;
use std::time::Duration;

use outbox_client::job_lock::{run_exclusive, Exclusive};
use outbox_tests::db::TestDb;
use outbox_tests::{eventually, unique};
use rand::{Rng, SeedableRng};
use tokio::process::Command;

const WORKER_BIN: &str = env!("CARGO_BIN_EXE_consumer-defenses-worker");
/// A ceiling on waits, never a claim about speed.
const PATIENCE: Duration = Duration::from_secs(120);

// ------------------------------------------------------------------- cron

async fn cron_tables(db: &TestDb) {
    let s = db.schema.quoted();
    db.client
        .batch_execute(&format!(
            "CREATE TABLE {s}.cron_runs (pid bigint NOT NULL); \
             CREATE TABLE {s}.cron_release (at timestamptz DEFAULT now())"
        ))
        .await
        .expect("cron tables");
}

/// Three processes start the same job at once: one runs it, two find it busy.
/// The runner holds the lock until released, so the overlap does not depend on
/// timing.
#[tokio::test]
async fn cron_job_started_by_three_processes_runs_once() {
    let db = TestDb::new().await;
    cron_tables(&db).await;
    let job = unique("report");
    let mut children: Vec<_> = (0..3)
        .map(|_| {
            Command::new(WORKER_BIN)
                .args(["cron", db.schema.as_str(), job.as_str()])
                .stdout(Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .expect("spawn worker")
        })
        .collect();
    let runs = format!("SELECT count(*) FROM {}.cron_runs", db.schema.quoted());

    // Wait for two processes to give up (busy) and one to be running the job.
    let mut exits = Vec::new();
    for child in &mut children {
        exits.push(child.try_wait().expect("poll"));
    }
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        for (i, child) in children.iter_mut().enumerate() {
            if exits[i].is_none() {
                exits[i] = child.try_wait().expect("poll");
            }
        }
        let started: i64 = db.client.query_one(&runs, &[]).await.expect("runs").get(0);
        if exits.iter().filter(|e| e.is_some()).count() == 2 && started == 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no settled state: exits {exits:?}, runs {started}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let busy: Vec<_> = exits.iter().flatten().map(|s| s.code()).collect();
    assert_eq!(busy, vec![Some(3), Some(3)], "the others found it busy");

    db.client
        .execute(
            &format!(
                "INSERT INTO {}.cron_release DEFAULT VALUES",
                db.schema.quoted()
            ),
            &[],
        )
        .await
        .expect("release");
    let mut outputs = Vec::new();
    for child in children {
        let out = tokio::time::timeout(PATIENCE, child.wait_with_output())
            .await
            .expect("worker exits")
            .expect("wait");
        outputs.push(String::from_utf8_lossy(&out.stdout).trim().to_owned());
    }
    outputs.sort();
    assert_eq!(outputs, ["busy", "busy", "ran"]);
    let started: i64 = db.client.query_one(&runs, &[]).await.expect("runs").get(0);
    assert_eq!(started, 1, "the job ran once");
    assert_eq!(advisory_locks_held(&db, &job).await, 0, "lock released");
    db.cleanup().await;
}

/// `pg_locks` (as `l`) of the job lock named `$1`, held.
const JOB_LOCKS: &str = "FROM pg_locks l, (SELECT hashtextextended($1, 0) AS k) h \
     WHERE l.locktype = 'advisory' AND l.granted \
       AND l.classid::bigint = ((h.k >> 32) & 4294967295) \
       AND l.objid::bigint = (h.k & 4294967295)";

async fn advisory_locks_held(db: &TestDb, name: &str) -> i64 {
    db.client
        .query_one(&format!("SELECT count(*) {JOB_LOCKS}"), &[&name])
        .await
        .expect("pg_locks")
        .get(0)
}

/// A job that panics releases the lock: the panic reaches the caller, and the
/// next run takes the lock at once.
#[tokio::test]
async fn cron_job_that_panics_releases_the_lock() {
    let db = TestDb::new().await;
    let job = unique("panics");
    let config = db.config.clone();
    let name = job.clone();
    let (running_tx, running_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        run_exclusive(&config, &name, |_| async move {
            let _ = running_tx.send(());
            tokio::task::yield_now().await;
            panic!("job failed");
        })
        .await
    });
    let _ = running_rx.await;
    let err = task.await.expect_err("the panic propagates");
    assert!(err.is_panic());
    assert!(
        eventually(PATIENCE, || async {
            advisory_locks_held(&db, &job).await == 0
        })
        .await,
        "lock still held after the panic"
    );
    let again = run_exclusive(&db.config, &job, |_| async { 7 })
        .await
        .expect("lock");
    assert_eq!(again, Exclusive::Ran(7));

    // While one run holds the lock, another is busy; dropping the holder mid-job
    // (cancellation) releases the lock too.
    let (held_tx, held_rx) = tokio::sync::oneshot::channel::<()>();
    let config = db.config.clone();
    let name = job.clone();
    let holder = tokio::spawn(async move {
        run_exclusive(&config, &name, |lease| async move {
            assert!(lease.is_held());
            let _ = held_tx.send(());
            futures::future::pending::<()>().await;
        })
        .await
    });
    held_rx.await.expect("holder runs");
    let busy = run_exclusive(&db.config, &job, |_| async {})
        .await
        .expect("lock query");
    assert_eq!(busy, Exclusive::Busy);
    holder.abort();
    let _ = holder.await;
    assert!(
        eventually(PATIENCE, || async {
            advisory_locks_held(&db, &job).await == 0
        })
        .await,
        "lock still held after cancellation"
    );
    db.cleanup().await;
}

/// A server that ends idle sessions (`idle_session_timeout`, set for the
/// database or role, as some teams do against leaked connections): the
/// lock's session sends nothing while the job runs, so the server ended it
/// mid-job, the lock went with it, and a second instance ran the job at the
/// same time; the first then got an unlock error and lost its output. The lock's
/// session now turns the timeout off for itself.
#[tokio::test]
async fn a_server_ending_idle_sessions_does_not_free_a_running_jobs_lock() {
    let db = TestDb::new().await;
    let job = unique("idle");
    let mut config = db.config.clone();
    config.options("-c idle_session_timeout=300");
    let (running_tx, running_rx) = tokio::sync::oneshot::channel::<()>();
    let (name, first_config) = (job.clone(), config.clone());
    let first = tokio::spawn(async move {
        run_exclusive(&first_config, &name, |_| async move {
            let _ = running_tx.send(());
            // Several idle timeouts long.
            tokio::time::sleep(Duration::from_millis(2_000)).await;
            "first"
        })
        .await
    });
    running_rx.await.expect("the first run started");
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let second = run_exclusive(&config, &job, |_| async { "second" })
        .await
        .expect("lock query");
    assert_eq!(
        second,
        Exclusive::Busy,
        "a second instance ran the job while the first still ran it"
    );
    let first = first.await.expect("no panic");
    assert!(
        matches!(first, Ok(Exclusive::Ran("first"))),
        "the first run lost its output: {first:?}"
    );
    db.cleanup().await;
}

/// The lock's session ended while the job ran (a failover, an operator's
/// `pg_terminate_backend`, a pooler restart): the job still finished, and its
/// output is the caller's to act on. It was dropped for `JobLockError::Unlock`,
/// so a report that was built and sent read as a failure; the caller now gets
/// the output, marked as run without the lock for part of its life.
#[tokio::test]
async fn a_job_whose_lock_session_ended_mid_run_still_returns_its_output() {
    let db = TestDb::new().await;
    let job = unique("terminated");
    let (running_tx, running_rx) = tokio::sync::oneshot::channel::<()>();
    let (lost_tx, lost_rx) = tokio::sync::oneshot::channel::<()>();
    let (config, name) = (db.config.clone(), job.clone());
    let run = tokio::spawn(async move {
        run_exclusive(&config, &name, |lease| async move {
            assert!(lease.is_held());
            let _ = running_tx.send(());
            let _ = lost_rx.await;
            // The job notices between steps, as the module advises.
            assert!(
                eventually(PATIENCE, || {
                    let held = lease.is_held();
                    async move { !held }
                })
                .await,
                "the lease still reads held after its session ended"
            );
            "report sent"
        })
        .await
    });
    running_rx.await.expect("the job started");
    let ended: i64 = db
        .client
        .query_one(
            &format!("SELECT count(pg_terminate_backend(l.pid)) {JOB_LOCKS}"),
            &[&job],
        )
        .await
        .expect("terminate the lock's session")
        .get(0);
    assert_eq!(ended, 1, "one session held the job's lock");
    let _ = lost_tx.send(());
    let outcome = run.await.expect("no panic");
    assert!(
        matches!(outcome, Ok(Exclusive::LostLock("report sent"))),
        "the job's output was not returned: {outcome:?}"
    );
    let again = run_exclusive(&db.config, &job, |_| async { "again" })
        .await
        .expect("lock");
    assert_eq!(again, Exclusive::Ran("again"), "the lock was left held");
    db.cleanup().await;
}

/// A job name with a NUL character is refused by name before connecting,
/// like every other key the client takes; it was a bare lock error from
/// Postgres, which cannot store one.
#[tokio::test]
async fn a_job_name_with_a_nul_is_refused_by_name() {
    let db = TestDb::new().await;
    let refused = run_exclusive(&db.config, "weekly\0report", |_| async {}).await;
    assert!(
        matches!(
            refused,
            Err(outbox_client::job_lock::JobLockError::NameContainsNul)
        ),
        "{refused:?}"
    );
    db.cleanup().await;
}

// ------------------------------------------------------------- checkpoint

/// A checkpointed job over 100,000 rows, SIGKILLed at random points and
/// restarted until done: every row's effect is applied exactly once.
#[tokio::test]
async fn checkpointed_job_killed_at_random_points_applies_each_row_once() {
    // Enough rows that five kills, each noticed up to a poll late, land
    // before the end on a fast machine: with 100,000 the worker did about
    // 200,000 rows a second, each kill came up to 10,000 rows past its
    // target, and the fourth came after the last row ("killed only after
    // finishing", OUTBOX_TEST_SEED=10533968339463809331).
    const ROWS: i64 = 1_000_000;
    let db = TestDb::new().await;
    let s = db.schema.quoted();
    db.client
        .batch_execute(&format!(
            "CREATE TABLE {s}.items (id bigint PRIMARY KEY, hits int NOT NULL DEFAULT 0); \
             INSERT INTO {s}.items (id) SELECT g FROM generate_series(1, {ROWS}) g"
        ))
        .await
        .expect("seed items");
    let job = outbox_client::checkpoint::Checkpoint::new(db.schema.clone(), "recount")
        .expect("checkpoint");
    let spawn = || {
        Command::new(WORKER_BIN)
            .args(["checkpoint", db.schema.as_str(), "recount", "1000"])
            .kill_on_drop(true)
            .spawn()
            .expect("spawn worker")
    };

    let mut rng = rand::rngs::StdRng::seed_from_u64(outbox_tests::seed());
    let mut kills = 0;
    let mut last_target = 0i64;
    while kills < 5 {
        // Random points, spread over the run and rising, so each restart resumes
        // from a different place: at most an eighth of the rows apart, so
        // five of them and their overshoot stay well short of the end.
        let target = last_target + rng.random_range(ROWS / 50..ROWS / 8);
        let mut child = spawn();
        let reached = eventually(PATIENCE, || async {
            job.position(&db.client)
                .await
                .expect("position")
                .unwrap_or(0)
                >= target
        })
        .await;
        assert!(reached, "no progress to {target}");
        assert!(
            child.try_wait().expect("poll").is_none(),
            "worker finished before it could be killed"
        );
        child.start_kill().expect("SIGKILL");
        let _ = child.wait().await;
        let at = job
            .position(&db.client)
            .await
            .expect("position")
            .unwrap_or(0);
        println!("killed at position {at} (target {target})");
        assert!(at < ROWS, "killed only after finishing");
        last_target = at;
        kills += 1;
    }
    let status = tokio::time::timeout(PATIENCE, spawn().wait())
        .await
        .expect("final run finishes")
        .expect("wait");
    assert!(status.success(), "final run failed: {status}");

    let (total, once, position): (i64, i64, Option<i64>) = {
        let r = db
            .client
            .query_one(
                &format!("SELECT count(*), count(*) FILTER (WHERE hits = 1) FROM {s}.items"),
                &[],
            )
            .await
            .expect("count");
        (
            r.get(0),
            r.get(1),
            job.position(&db.client).await.expect("position"),
        )
    };
    assert_eq!(total, ROWS);
    assert_eq!(once, ROWS, "rows applied other than once");
    assert_eq!(position, Some(ROWS));
    db.cleanup().await;
}
