//! The fault-injection correctness suite: each scenario runs writers and a relay
//! under one fault and checks, with an independent consumer, that nothing was
//! lost, nothing rolled back arrived, duplicates stayed within the scenario's
//! stated bound, ids were stable and per-key order held.
//!
//! Each scenario appends a row to the summary table that `tests/run.sh` prints.
//! `OUTBOX_CORRECTNESS_PROFILE=long` scales the workloads up for soak runs
//! (see README).
//!
//! Broker and database restarts live in their own test binaries
//! (`amqp_outage.rs`, `pg_restart.rs`): they would disturb scenarios running
//! beside them. Here faults touch only the scenario's own relay or connection.

use std::time::Duration;

use outbox_tests::check::Report;
use outbox_tests::db::TestDb;
use outbox_tests::process::RelayProcess;
use outbox_tests::sink::Sink;
use outbox_tests::workload::{Spec, Written};

mod database;
mod mutants;
mod network;
mod process_faults;

const RELAY_BIN: &str = env!("CARGO_BIN_EXE_outbox-relay-under-test");
const TMP: &str = env!("CARGO_TARGET_TMPDIR");
const PATIENCE: Duration = Duration::from_secs(300);
const BATCH: usize = 100;
const PIPELINE: usize = 2;

/// Messages per scenario: small for CI, large for soak runs.
fn scale(ci: usize) -> usize {
    match std::env::var("OUTBOX_CORRECTNESS_PROFILE").as_deref() {
        Ok("long") => 1_000_000,
        _ => ci,
    }
}

/// The relay's environment for `db` and `sink`; `via` is a proxy's address in
/// front of the broker, if any.
fn env_for(db: &TestDb, sink: &Sink, via: Option<&str>) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("OUTBOX_SCHEMA", db.schema.to_string()),
        ("OUTBOX_BATCH_SIZE", BATCH.to_string()),
        ("OUTBOX_PIPELINE", PIPELINE.to_string()),
        ("OUTBOX_POLL_INTERVAL", "200ms".into()),
        ("OUTBOX_RECONNECT_MAX", "1s".into()),
        ("OUTBOX_CONFIRM_TIMEOUT", "3s".into()),
        ("OUTBOX_HOLD_LIMIT", "10s".into()),
    ];
    env.extend(sink.relay_env(via));
    env
}

fn spec(sink: &Sink, messages: usize) -> Spec {
    Spec {
        max_commit_delay: Duration::from_millis(10),
        ..Spec::new(sink.destination(), 6, 60, messages)
    }
}

/// Waits for the outbox to drain and the consumer to catch up, then checks.
async fn settle(db: &TestDb, sink: &Sink, written: &Written) -> Report {
    sink.settle(db, written, PATIENCE).await
}

/// [`settle`], then records the scenario's row under `name` and checks it:
/// nothing lost, nothing unexpected, no more than `bound` duplicates.
async fn settle_within(
    db: &TestDb,
    sink: &Sink,
    written: &Written,
    name: &str,
    started: std::time::Instant,
    bound: usize,
) -> Report {
    let report = settle(db, sink, written).await;
    outbox_tests::check::judge(TMP, name, &report, started, Some(bound));
    report
}

async fn stop(mut relay: RelayProcess) {
    relay.signal("TERM").await;
    assert_eq!(relay.wait().await, Some(0), "clean exit on SIGTERM");
}
