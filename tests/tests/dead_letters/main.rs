//! Poison messages, parking, dead-letter retry/discard, and the operator CLI.

use std::time::Duration;

use outbox_client::Message;
use outbox_tests::db::TestDb;
use outbox_tests::fast_settings;

mod operator_cli;
mod parking;
mod races;
mod retention;

const RELAY_BIN: &str = env!("CARGO_BIN_EXE_outbox-relay-under-test");
const PATIENCE: Duration = Duration::from_secs(120);

fn settings(park: bool) -> outbox_relay::Settings {
    outbox_relay::Settings {
        max_attempts: 3,
        retry_base: Duration::from_millis(50),
        retry_max: Duration::from_millis(200),
        park_on_dead_letter: park,
        ..fast_settings()
    }
}

/// Runs the relay CLI against `db` and returns (exit code, stdout, stderr).
async fn cli(db: &TestDb, args: &[&str]) -> (i32, String, String) {
    let (code, out, err) = outbox_tests::process::cli(RELAY_BIN, db.schema.as_str(), args).await;
    (code.unwrap_or(-1), out, err)
}

fn msg(dest: &str, key: &str, n: i32) -> Message {
    Message::builder(dest)
        .key(key)
        .json(&n)
        .build()
        .expect("valid")
}
