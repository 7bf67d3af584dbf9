//! Logs never carry the database password or message payloads.

use std::time::Duration;

use outbox_client::Message;
use outbox_tests::amqp::Fixture;
use outbox_tests::db::TestDb;
use outbox_tests::eventually;
use tokio::process::Command;

use super::{PATIENCE, RELAY_BIN};

/// A relay process on RabbitMQ whose output (stdout and stderr) is kept,
/// read as it is written so that a full pipe never stalls it.
struct Logged {
    child: tokio::process::Child,
    out: tokio::task::JoinHandle<Vec<u8>>,
    err: tokio::task::JoinHandle<Vec<u8>>,
}

impl Logged {
    /// Starts the relay on `database_url` and `schema`, logging at `log`.
    fn start(database_url: &str, schema: &str, log: &str) -> Logged {
        let mut child = Command::new(RELAY_BIN)
            .arg("run")
            .env("OUTBOX_DATABASE_URL", database_url)
            .env("OUTBOX_AMQP_URL", outbox_tests::amqp_url())
            .env("OUTBOX_SCHEMA", schema)
            .env("OUTBOX_HTTP_ADDR", "127.0.0.1:0")
            .env("OUTBOX_LOG", log)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("relay");
        let drain = |mut pipe: Box<dyn tokio::io::AsyncRead + Send + Unpin>| {
            tokio::spawn(async move {
                let mut v = Vec::new();
                let _ = tokio::io::AsyncReadExt::read_to_end(&mut pipe, &mut v).await;
                v
            })
        };
        let out = drain(Box::new(child.stdout.take().expect("stdout")));
        let err = drain(Box::new(child.stderr.take().expect("stderr")));
        Logged { child, out, err }
    }

    /// Stops the relay with SIGTERM and returns all it wrote.
    async fn stop(mut self) -> String {
        let pid = self.child.id().expect("pid");
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(pid.to_string())
            .status()
            .await;
        let _ = self.child.wait().await;
        format!(
            "{}{}",
            String::from_utf8_lossy(&self.out.await.expect("stdout")),
            String::from_utf8_lossy(&self.err.await.expect("stderr"))
        )
    }
}

#[tokio::test]
async fn logs_never_show_the_password_or_payloads() {
    let db = TestDb::new().await;
    let rabbit = Fixture::new().await;
    const PASSWORD: &str = "pw-sentinel-7f3a9";
    const PAYLOAD: &str = "payload-sentinel-c41e";
    // Trust authentication ignores the password, so it only travels through
    // the relay's configuration: exactly what must not leak.
    let url = outbox_tests::pg_url().replacen("postgres@", &format!("postgres:{PASSWORD}@"), 1);
    assert!(
        url.contains(PASSWORD),
        "test URL must carry the password: {url}"
    );
    let log = std::env::var("OUTBOX_TEST_LEAK_LOG").unwrap_or_else(|_| "trace".into());
    let relay = Logged::start(&url, db.schema.as_str(), &log);
    let unroutable = outbox_tests::unique("nowhere");
    outbox_tests::amqp::declare_unbound_exchange(&unroutable).await;
    let messages: Vec<Message> = (0..50)
        .map(|i| {
            let dest = if i == 0 {
                unroutable.as_str()
            } else {
                rabbit.exchange.as_str()
            };
            Message::builder(dest)
                .payload(format!("{PAYLOAD}-{i}"))
                .header("h", "v")
                .build()
                .expect("valid")
        })
        .collect();
    db.outbox()
        .enqueue_batch(&db.client, &messages)
        .await
        .expect("enqueue");
    assert!(eventually(PATIENCE, || async { rabbit.count() >= 49 }).await);
    // Let the rejected message's warnings be logged too.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let text = relay.stop().await;
    assert!(
        text.contains("relay running"),
        "the log scan must see real logs:\n{text}"
    );
    assert!(
        text.contains("broker rejected message"),
        "the rejection path must have logged"
    );
    assert!(!text.contains(PASSWORD), "password leaked into the logs");
    assert!(!text.contains(PAYLOAD), "payload leaked into the logs");
    // Debug output shows bytes as numbers: lapin logs a returned message
    // that way, so the sentinel must not appear in that form either.
    let as_bytes = format!("{:?}", &PAYLOAD.as_bytes()[..8]);
    let as_bytes = as_bytes.trim_start_matches('[').trim_end_matches(']');
    assert!(
        !text.contains(as_bytes),
        "payload bytes leaked into the logs (as {as_bytes})"
    );
    outbox_tests::amqp::delete_exchange(&unroutable).await;
    rabbit.cleanup().await;
    db.cleanup().await;
}

/// A relay pointed at a server that takes no writes (a standby after a
/// failover, `default_transaction_read_only` on for its role or database)
/// says what that means and what to do, not only Postgres's "cannot
/// execute INSERT in a read-only transaction".
#[tokio::test]
async fn a_read_only_server_is_named_with_its_remedy() {
    let db = TestDb::new().await;
    let url = format!(
        "{}?options=-c%20default_transaction_read_only%3Don",
        db.url()
    );
    let relay = Logged::start(&url, db.schema.as_str(), "warn");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let text = relay.stop().await;
    assert!(
        text.contains("25006"),
        "the relay never met the read-only server:\n{text}"
    );
    assert!(
        text.lines()
            .filter(|l| l.contains("25006"))
            .all(|l| l.contains("standby") && l.contains("target_session_attrs=read-write")),
        "a read-only error without what it means and what to do:\n{text}"
    );
    db.cleanup().await;
}
