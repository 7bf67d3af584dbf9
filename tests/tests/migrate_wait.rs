//! `outbox-relay migrate` started before Postgres accepts connections (a
//! compose file or a Kubernetes Job starting beside the database) waits for
//! it, saying so once; errors a starting server does not give fail at once.

use std::process::Stdio;
use std::time::Duration;

use outbox_tests::free_port;
use outbox_tests::proxy::Proxy;
use tokio::net::TcpListener;
use tokio::process::Command;

const RELAY_BIN: &str = env!("CARGO_BIN_EXE_outbox-relay-under-test");

fn migrate(url: &str, schema: &str, wait: &str) -> Command {
    let mut cmd = Command::new(RELAY_BIN);
    cmd.args(["migrate", "--wait", wait])
        .env("OUTBOX_DATABASE_URL", url)
        .env("OUTBOX_SCHEMA", schema)
        .env("OUTBOX_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

#[tokio::test]
async fn migrate_waits_for_postgres_to_come_up_and_says_so_once() {
    let port = free_port();
    let schema = outbox_tests::unique("mw");
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    let child = migrate(&url, &schema, "60s")
        .spawn()
        .expect("spawn migrate");
    // Nothing listens on the port for a while: migrate keeps trying.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let listener = TcpListener::bind(("127.0.0.1", port))
        .await
        .expect("take the port back");
    let _postgres = Proxy::start_on(listener, "127.0.0.1:5432");
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("migrate finished")
        .expect("wait");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("is up to date"), "{stdout}");
    assert_eq!(
        stderr.matches("waiting for postgres").count(),
        1,
        "one line while waiting, not one per attempt: {stderr}"
    );
    let client =
        outbox_tests::db::connect(&outbox_tests::pg_url().parse().expect("test database url"))
            .await;
    client
        .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .await
        .expect("the schema was migrated");
}

#[tokio::test]
async fn migrate_fails_at_once_on_what_waiting_cannot_fix() {
    // An unknown database: the server answers, so there is nothing to wait
    // for (with an hour allowed, it still fails on the first answer).
    let out = migrate(
        "postgres://postgres@127.0.0.1:5432/no_such_database_here",
        "outbox",
        "1h",
    )
    .output()
    .await
    .expect("run migrate");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("no_such_database_here"), "{stderr}");
    assert!(!stderr.contains("waiting for postgres"), "{stderr}");
    // Nobody ever listens: it gives up when the wait is over, naming why.
    let port = free_port();
    let out = migrate(
        &format!("postgres://postgres@127.0.0.1:{port}/postgres"),
        "outbox",
        "1s",
    )
    .output()
    .await
    .expect("run migrate");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.to_lowercase().contains("refused"), "{stderr}");
}

/// `run` as well: an unknown database or user is a configuration error,
/// reported once with the server's message, not retried forever.
#[tokio::test]
async fn run_stops_at_start_up_on_a_wrong_database_or_user_with_the_servers_message() {
    for (url, named) in [
        (
            "postgres://postgres@127.0.0.1:5432/no_such_database_for_run",
            "no_such_database_for_run",
        ),
        (
            "postgres://no_such_role_for_run@127.0.0.1:5432/postgres",
            "no_such_role_for_run",
        ),
    ] {
        let out = Command::new(RELAY_BIN)
            .arg("run")
            .env("OUTBOX_DATABASE_URL", url)
            .env("OUTBOX_HTTP_ADDR", "off")
            .env("OUTBOX_LOG", "warn")
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(Duration::from_secs(60), out)
            .await
            .expect("run should stop instead of retrying forever")
            .expect("run relay");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains(named),
            "the server's message names it: {stderr}"
        );
        assert!(!stderr.contains("retrying"), "{stderr}");
        assert_eq!(
            stderr.lines().filter(|l| l.contains(named)).count(),
            1,
            "{stderr}"
        );
    }
}
