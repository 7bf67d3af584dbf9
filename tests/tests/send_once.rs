//! Side effects outside the database sent once, against a real Postgres:
//! send-once notifications in both orders (record-then-send and
//! send-then-record), and the webhook example as a process, applying an event
//! posted many times once.

use std::process::Stdio;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use outbox_client::send_once::{Notification, Order, SendOnce, SendOnceError, Sent};
use outbox_tests::db::{connect, TestDb};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

const WEBHOOK_BIN: &str = env!("CARGO_BIN_EXE_webhook-example");
/// A ceiling on waits, never a claim about speed.
const PATIENCE: Duration = Duration::from_secs(120);

// -------------------------------------------------------------- send once

/// Both orders: concurrent attempts send once; a failed send is retried under
/// send-then-record and left unsent (and listed) under record-then-send.
#[tokio::test]
async fn send_once_orders_behave_as_documented() {
    let db = TestDb::new().await;
    let notes = SendOnce::with_schema(db.schema.clone());

    for order in [Order::RecordThenSend, Order::SendThenRecord] {
        let n = Notification::new("user-1", format!("{order:?}"), "once").expect("key");
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let attempts = (0..8).map(|_| {
            let notes = notes.clone();
            let n = n.clone();
            let calls = Arc::clone(&calls);
            let config = db.config.clone();
            tokio::spawn(async move {
                let mut client = connect(&config).await;
                notes
                    .send(&mut client, &n, order, || async {
                        calls.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        Ok::<(), std::io::Error>(())
                    })
                    .await
                    .expect("send once")
            })
        });
        let results = futures::future::join_all(attempts).await;
        let sent = results
            .into_iter()
            .filter(|r| *r.as_ref().expect("task") == Sent::Sent)
            .count();
        assert_eq!(sent, 1, "{order:?}");
        assert_eq!(calls.load(Ordering::SeqCst), 1, "{order:?}");
    }

    let mut client = connect(&db.config).await;
    let fail = || async { Err::<(), _>(std::io::Error::other("smtp down")) };
    let ok = || async { Ok::<(), std::io::Error>(()) };

    let email = Notification::new("user-2", "welcome", "once").expect("key");
    let r = notes
        .send(&mut client, &email, Order::SendThenRecord, fail)
        .await;
    assert!(matches!(r, Err(SendOnceError::Send(_))));
    let r = notes
        .send(&mut client, &email, Order::SendThenRecord, ok)
        .await;
    assert!(
        matches!(r, Ok(Sent::Sent)),
        "send-then-record retries a failed send"
    );

    let payout = Notification::new("user-2", "payout", "2026-W42").expect("key");
    let r = notes
        .send(&mut client, &payout, Order::RecordThenSend, fail)
        .await;
    assert!(matches!(r, Err(SendOnceError::Send(_))));
    let r = notes
        .send(&mut client, &payout, Order::RecordThenSend, ok)
        .await;
    assert!(
        matches!(r, Ok(Sent::AlreadySent)),
        "record-then-send never repeats"
    );
    let unconfirmed = notes
        .unconfirmed(&client, Duration::ZERO)
        .await
        .expect("unconfirmed");
    assert_eq!(unconfirmed, vec![payout.clone()]);
    assert!(notes.forget(&client, &payout).await.expect("forget"));
    let r = notes
        .send(&mut client, &payout, Order::RecordThenSend, ok)
        .await;
    assert!(matches!(r, Ok(Sent::Sent)));
    assert!(notes
        .unconfirmed(&client, Duration::ZERO)
        .await
        .expect("unconfirmed")
        .is_empty());
    db.cleanup().await;
}

// ---------------------------------------------------------------- webhook

/// Send-then-record keeps its record's transaction open, idle, while the
/// send runs. A server that ends sessions idle in a transaction
/// (`idle_in_transaction_session_timeout`, often 30-60 s on managed
/// Postgres) ended it mid-send: the key was freed, an attempt waiting on it
/// sent the notification too, and the first failed its commit. The record's
/// transaction now turns the timeout off for itself.
#[tokio::test]
async fn send_then_record_outlasting_the_servers_idle_in_transaction_timeout_sends_once() {
    let db = TestDb::new().await;
    let notes = SendOnce::with_schema(db.schema.clone());
    let mut config = db.config.clone();
    config.options("-c idle_in_transaction_session_timeout=300");
    let n = Notification::new("user-1", "slow-send", "once").expect("key");
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (sending_tx, sending_rx) = tokio::sync::oneshot::channel::<()>();
    let first = {
        let (notes, n, calls, config) =
            (notes.clone(), n.clone(), Arc::clone(&calls), config.clone());
        tokio::spawn(async move {
            let mut client = connect(&config).await;
            notes
                .send(&mut client, &n, Order::SendThenRecord, || async move {
                    calls.fetch_add(1, Ordering::SeqCst);
                    let _ = sending_tx.send(());
                    // Several idle timeouts long.
                    tokio::time::sleep(Duration::from_millis(2_000)).await;
                    Ok::<(), std::io::Error>(())
                })
                .await
        })
    };
    sending_rx.await.expect("the first attempt is sending");
    let mut client = connect(&config).await;
    let second = notes
        .send(&mut client, &n, Order::SendThenRecord, || async {
            calls.fetch_add(1, Ordering::SeqCst);
            Ok::<(), std::io::Error>(())
        })
        .await;
    let first = first.await.expect("no panic");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "sent twice: first {first:?}, second {second:?}"
    );
    assert!(matches!(first, Ok(Sent::Sent)), "{first:?}");
    assert!(matches!(second, Ok(Sent::AlreadySent)), "{second:?}");
    db.cleanup().await;
}

/// POSTs `body` to `addr` over plain HTTP/1.1 and returns the status code and body.
async fn post(addr: &str, path: &str, body: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to webhook");
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream
        .write_all(request.as_bytes())
        .await
        .expect("send request");
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .await
        .expect("read response");
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.trim().to_owned())
        .unwrap_or_default();
    (status, body)
}

/// The webhook example as a process: one event posted 5 times at once is
/// applied once, and every response is 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_event_posted_five_times_is_applied_once_all_200() {
    let db = TestDb::new().await;
    let mut server = Command::new(WEBHOOK_BIN)
        .env("DATABASE_URL", outbox_tests::pg_url())
        .env("WEBHOOK_SCHEMA", db.schema.as_str())
        .env("WEBHOOK_ADDR", "127.0.0.1:0")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn webhook example");
    let stdout = server.stdout.take().expect("stdout");
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = tokio::time::timeout(PATIENCE, lines.next_line())
        .await
        .expect("server starts")
        .expect("read stdout")
        .expect("a line");
    let addr = line
        .strip_prefix("listening on ")
        .expect("listening line")
        .to_owned();

    let event =
        r#"{"id":"evt_1Nx","type":"credit.granted","data":{"account":"acme","amount":100}}"#;
    let posts = (0..5).map(|_| {
        let addr = addr.clone();
        tokio::spawn(async move { post(&addr, "/webhooks/payments", event).await })
    });
    let responses: Vec<(u16, String)> = futures::future::join_all(posts)
        .await
        .into_iter()
        .map(|r| r.expect("task"))
        .collect();
    assert!(
        responses.iter().all(|(status, _)| *status == 200),
        "{responses:?}"
    );
    assert_eq!(
        responses.iter().filter(|(_, b)| b == "applied").count(),
        1,
        "{responses:?}"
    );
    let credits: i64 = db
        .client
        .query_one(
            &format!(
                "SELECT credits FROM {}.webhook_accounts WHERE account = 'acme'",
                db.schema.quoted()
            ),
            &[],
        )
        .await
        .expect("credits")
        .get(0);
    assert_eq!(credits, 100, "applied once");

    // A later resend is still a 200 duplicate.
    let (status, body) = post(&addr, "/webhooks/payments", event).await;
    assert_eq!((status, body.as_str()), (200, "duplicate"));
    let _ = server.kill().await;
    db.cleanup().await;
}
