//! Idempotency keys over HTTP, against a real Postgres: the axum extractor
//! and `Idempotency::respond` under double clicks (reject and wait modes),
//! retries after a client timeout, reuse with another body, missing or
//! malformed keys, handlers that fail or panic, and repeated retries.
//!
//! The tests run a small axum service in-process whose handler writes an
//! effect row and an outbox message in the request's transaction. A script in
//! the service state makes the next request fail, panic or hold until the test
//! releases it, so overlaps are arranged by the test rather than hoped for
//! with sleeps.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use outbox_client::idempotency::axum::{IdempotentRequest, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED};
use outbox_client::idempotency::{Idempotency, WhenInProgress};
use outbox_client::{Message, Outbox};
use outbox_tests::db::TestDb;
use outbox_tests::eventually;
use outbox_tests::idempotency::SCOPE;
use tokio::sync::{mpsc, Semaphore};

#[allow(dead_code)] // its main() and all but the pool this suite borrows
#[path = "../../outbox-client/examples/credits.rs"]
mod credits;

/// Ceiling on any wait; a healthy run needs a small fraction of it.
const PATIENCE: Duration = Duration::from_secs(60);

/// What the handler does on its next call, after writing its effect and
/// outbox message.
#[derive(Debug, Clone, Copy)]
enum Step {
    /// Return an error: the request must roll back.
    Fail,
    /// Panic: the request must roll back.
    Panic,
    /// Signal `entered`, then wait for one `release` permit.
    Hold,
}

#[derive(Clone)]
struct Svc {
    pool: deadpool_postgres::Pool,
    idempotency: Idempotency,
    outbox: Outbox,
    effects: String,
    script: Arc<Mutex<VecDeque<Step>>>,
    entered: mpsc::UnboundedSender<()>,
    release: Arc<Semaphore>,
}

/// A running test service on a fresh schema.
struct Service {
    db: TestDb,
    base: String,
    script: Arc<Mutex<VecDeque<Step>>>,
    entered: mpsc::UnboundedReceiver<()>,
    release: Arc<Semaphore>,
    http: reqwest::Client,
    app_name: String,
}

impl Service {
    async fn start(when: WhenInProgress) -> Service {
        let db = TestDb::new().await;
        db.client
            .batch_execute(&format!(
                "CREATE TABLE {}.effects (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
                 amount bigint NOT NULL)",
                db.schema.quoted()
            ))
            .await
            .expect("create effects");
        // Tagging the pool's sessions lets a test find them in pg_stat_activity
        // while other tests run in parallel.
        let app_name = db.schema.as_str().to_owned();
        let mut config = db.config.clone();
        config.application_name(&app_name);
        let pool = credits::pool(config).expect("pool");
        let script = Arc::new(Mutex::new(VecDeque::new()));
        let release = Arc::new(Semaphore::new(0));
        let (entered_tx, entered) = mpsc::unbounded_channel();
        let svc = Svc {
            pool,
            idempotency: Idempotency::with_schema(db.schema.clone()).when_in_progress(when),
            outbox: db.outbox(),
            effects: format!("{}.effects", db.schema.quoted()),
            script: script.clone(),
            entered: entered_tx,
            release: release.clone(),
        };
        let router = Router::new()
            .route("/effects", post(effect))
            .with_state(svc);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        tokio::spawn(async move { axum::serve(listener, router).await });
        Service {
            db,
            base,
            script,
            entered,
            release,
            http: reqwest::Client::builder()
                .timeout(PATIENCE)
                .build()
                .expect("http client"),
            app_name,
        }
    }

    fn then(&self, step: Step) {
        self.script.lock().expect("script").push_back(step);
    }

    fn post(&self, key: Option<&str>, amount: i64) -> reqwest::RequestBuilder {
        let request = self
            .http
            .post(format!("{}/effects", self.base))
            .header("content-type", "application/json")
            .body(format!("{{\"amount\":{amount}}}"));
        match key {
            Some(key) => request.header(IDEMPOTENCY_KEY.as_str(), key),
            None => request,
        }
    }

    async fn send(&self, key: Option<&str>, amount: i64) -> Reply {
        Reply::from(self.post(key, amount).send().await.expect("response")).await
    }

    async fn effects(&self) -> i64 {
        self.db.count("effects").await
    }

    async fn outbox_rows(&self) -> i64 {
        self.db.pending().await
    }

    async fn entered(&mut self) {
        tokio::time::timeout(PATIENCE, self.entered.recv())
            .await
            .expect("handler entered within the ceiling")
            .expect("service alive");
    }
}

/// The parts of a response a client would compare.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Reply {
    status: u16,
    replayed: bool,
    content_type: Option<String>,
    location: Option<String>,
    not_stored: Option<String>,
    retry_after: Option<String>,
    body: Vec<u8>,
}

impl Reply {
    async fn from(response: reqwest::Response) -> Reply {
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .map(|v| v.to_str().expect("ascii header").to_owned())
        };
        Reply {
            status: response.status().as_u16(),
            replayed: header(IDEMPOTENT_REPLAYED.as_str()).as_deref() == Some("true"),
            content_type: header("content-type"),
            location: header("location"),
            not_stored: header("x-not-stored"),
            retry_after: header("retry-after"),
            body: response.bytes().await.expect("body").to_vec(),
        }
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

#[derive(serde::Deserialize)]
struct EffectRequest {
    amount: i64,
}

/// Writes an effect row and an outbox message, then follows the script.
async fn effect(State(svc): State<Svc>, request: IdempotentRequest) -> Response {
    let Ok(EffectRequest { amount }) = serde_json::from_slice(request.body()) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let step = svc.script.lock().expect("script").pop_front();
    // Spawned, as a real service would, so that a client hanging up does not
    // cancel the request: the timeout tests rely on the first attempt finishing.
    let task = tokio::spawn(async move {
        let mut client = svc.pool.get().await.expect("pooled connection");
        let Svc {
            idempotency,
            outbox,
            effects,
            entered,
            release,
            ..
        } = svc;
        idempotency
            .respond(&mut client, SCOPE, &request, move |tx| {
                Box::pin(async move {
                    let id: i64 = tx
                        .query_one(
                            &format!("INSERT INTO {effects} (amount) VALUES ($1) RETURNING id"),
                            &[&amount],
                        )
                        .await
                        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?
                        .get(0);
                    outbox
                        .enqueue(
                            tx,
                            &Message::builder("effects")
                                .key(format!("effect-{id}"))
                                .json(&serde_json::json!({ "effect": id, "amount": amount }))
                                .build()
                                .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?,
                        )
                        .await
                        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
                    match step {
                        Some(Step::Fail) => return Err(StatusCode::INTERNAL_SERVER_ERROR),
                        Some(Step::Panic) => panic!("handler crashed mid-request"),
                        Some(Step::Hold) => {
                            let _ = entered.send(());
                            release.acquire().await.expect("semaphore open").forget();
                        }
                        None => {}
                    }
                    Ok((
                        StatusCode::CREATED,
                        [
                            ("location", format!("/effects/{id}")),
                            ("x-not-stored", "first-response-only".to_owned()),
                        ],
                        Json(serde_json::json!({ "effect": id, "amount": amount })),
                    ))
                })
            })
            .await
    });
    task.await
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

fn new_key() -> String {
    uuid::Uuid::new_v4().to_string()
}

#[tokio::test]
async fn double_click_in_reject_mode_answers_409_and_applies_once() {
    let mut svc = Service::start(WhenInProgress::Reject).await;
    let key = new_key();
    svc.then(Step::Hold);
    let first = tokio::spawn(svc.post(Some(&key), 5).send());
    svc.entered().await;

    let second = svc.send(Some(&key), 5).await;
    assert_eq!(second.status, 409, "{}", second.text());
    assert_eq!(second.retry_after.as_deref(), Some("1"));
    assert!(!second.replayed);

    svc.release.add_permits(1);
    let first = Reply::from(first.await.expect("join").expect("response")).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(!first.replayed);
    assert_eq!(svc.effects().await, 1);
    assert_eq!(svc.outbox_rows().await, 1);

    // Once the first has committed, the same click replays it.
    let third = svc.send(Some(&key), 5).await;
    assert_eq!((third.status, third.replayed), (201, true));
    assert_eq!(third.body, first.body);
    assert_eq!(svc.effects().await, 1);
    svc.db.cleanup().await;
}

#[tokio::test]
async fn double_click_in_wait_mode_gets_the_first_response() {
    let mut svc = Service::start(WhenInProgress::Wait(PATIENCE)).await;
    let key = new_key();
    svc.then(Step::Hold);
    let first = tokio::spawn(svc.post(Some(&key), 7).send());
    svc.entered().await;
    let second = tokio::spawn(svc.post(Some(&key), 7).send());

    // Release the first only once the second has tried the key's lock and is
    // polling: its session sits idle in a transaction whose last statement was
    // the lock attempt (had it got the lock, it would have moved on).
    let probe = &svc.db.client;
    let app_name = svc.app_name.clone();
    assert!(
        eventually(PATIENCE, || async {
            probe
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 \
                     AND state = 'idle in transaction' \
                     AND query LIKE 'SELECT pg_try_advisory_xact_lock%'",
                    &[&app_name],
                )
                .await
                .expect("pg_stat_activity")
                .get::<_, i64>(0)
                == 1
        })
        .await,
        "second request never started waiting"
    );
    assert!(
        !second.is_finished(),
        "second answered while the first held the key"
    );

    svc.release.add_permits(1);
    let first = Reply::from(first.await.expect("join").expect("response")).await;
    let second = Reply::from(second.await.expect("join").expect("response")).await;
    assert_eq!(
        (first.status, first.replayed),
        (201, false),
        "{}",
        first.text()
    );
    assert_eq!(
        (second.status, second.replayed),
        (201, true),
        "{}",
        second.text()
    );
    assert_eq!(second.body, first.body);
    assert_eq!(svc.effects().await, 1);
    assert_eq!(svc.outbox_rows().await, 1);
    svc.db.cleanup().await;
}

#[tokio::test]
async fn retry_after_a_client_timeout_replays_the_committed_response() {
    let mut svc = Service::start(WhenInProgress::Reject).await;
    let key = new_key();
    svc.then(Step::Hold);
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .expect("client");
    let timed_out = impatient
        .post(format!("{}/effects", svc.base))
        .header(IDEMPOTENCY_KEY.as_str(), &key)
        .body("{\"amount\":100}")
        .send()
        .await;
    // The handler holds until released, so the client can only time out.
    assert!(
        timed_out.as_ref().is_err_and(|e| e.is_timeout()),
        "{timed_out:?}"
    );
    svc.entered().await;
    svc.release.add_permits(1);
    // The server finishes the abandoned request and commits it.
    assert!(eventually(PATIENCE, || async { svc.effects().await == 1 }).await);

    let retry = svc.send(Some(&key), 100).await;
    assert_eq!(
        (retry.status, retry.replayed),
        (201, true),
        "{}",
        retry.text()
    );
    let (effect_id, stored_body): (i64, Vec<u8>) = {
        let row = svc
            .db
            .client
            .query_one(
                &format!(
                    "SELECT (SELECT id FROM {s}.effects), response_body \
                     FROM {s}.idempotency_keys WHERE key = $1",
                    s = svc.db.schema.quoted()
                ),
                &[&key],
            )
            .await
            .expect("record");
        (row.get(0), row.get(1))
    };
    // The body the first attempt produced and the client never saw.
    assert_eq!(retry.body, stored_body);
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&retry.body).expect("json"),
        serde_json::json!({ "effect": effect_id, "amount": 100 })
    );
    assert_eq!(retry.location, Some(format!("/effects/{effect_id}")));
    assert_eq!(svc.effects().await, 1);
    assert_eq!(svc.outbox_rows().await, 1);
    svc.db.cleanup().await;
}

#[tokio::test]
async fn same_key_with_another_body_is_422_and_applies_nothing() {
    let svc = Service::start(WhenInProgress::Reject).await;
    let key = new_key();
    let first = svc.send(Some(&key), 1).await;
    assert_eq!(first.status, 201, "{}", first.text());

    let other = svc.send(Some(&key), 2).await;
    assert_eq!(other.status, 422, "{}", other.text());
    assert!(
        other.text().contains("different request"),
        "{}",
        other.text()
    );
    assert_eq!(svc.effects().await, 1);
    assert_eq!(svc.outbox_rows().await, 1);
    let amounts: Vec<i64> = svc
        .db
        .column(&format!(
            "SELECT amount FROM {}.effects",
            svc.db.schema.quoted()
        ))
        .await;
    assert_eq!(amounts, [1]);

    // The original request with the key still replays.
    let again = svc.send(Some(&key), 1).await;
    assert_eq!(
        (again.status, again.replayed, again.body),
        (201, true, first.body)
    );
    svc.db.cleanup().await;
}

#[tokio::test]
async fn missing_or_malformed_key_is_400_and_applies_nothing() {
    let svc = Service::start(WhenInProgress::Reject).await;
    let missing = svc.send(None, 1).await;
    assert_eq!(missing.status, 400);
    assert!(
        missing.text().contains("missing Idempotency-Key"),
        "{}",
        missing.text()
    );
    for bad in ["has space", &"k".repeat(256)] {
        let reply = svc.send(Some(bad), 1).await;
        assert_eq!(reply.status, 400, "{bad:?}");
        assert!(
            reply.text().contains("invalid Idempotency-Key"),
            "{}",
            reply.text()
        );
    }
    let twice = svc
        .post(Some("a"), 1)
        .header(IDEMPOTENCY_KEY.as_str(), "b")
        .send()
        .await
        .expect("response");
    assert_eq!(twice.status(), 400);
    // The longest valid key works.
    let longest = svc.send(Some(&"k".repeat(255)), 1).await;
    assert_eq!(longest.status, 201, "{}", longest.text());
    assert_eq!(svc.effects().await, 1);
    svc.db.cleanup().await;
}

#[tokio::test]
async fn handler_error_or_panic_rolls_back_and_the_retry_runs() {
    let svc = Service::start(WhenInProgress::Reject).await;
    for step in [Step::Fail, Step::Panic] {
        let key = new_key();
        let before = svc.effects().await;
        svc.then(step);
        let failed = svc.send(Some(&key), 3).await;
        assert_eq!(failed.status, 500, "{step:?}");
        // The effect and the outbox message written before the failure are gone.
        assert_eq!(svc.effects().await, before, "{step:?}");
        assert_eq!(svc.outbox_rows().await, before, "{step:?}");

        // The key is not stuck. A rollback that the crashed request queued may
        // still be on its way to the server; until then the key answers 409.
        let mut retry = svc.send(Some(&key), 3).await;
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while retry.status == 409 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
            retry = svc.send(Some(&key), 3).await;
        }
        assert_eq!(
            (retry.status, retry.replayed),
            (201, false),
            "{step:?}: {}",
            retry.text()
        );
        assert_eq!(svc.effects().await, before + 1, "{step:?}");
        assert_eq!(svc.outbox_rows().await, before + 1, "{step:?}");
    }
    svc.db.cleanup().await;
}

#[tokio::test]
async fn five_retries_leave_exactly_one_effect_and_one_outbox_row() {
    let svc = Service::start(WhenInProgress::Reject).await;
    let key = new_key();
    let first = svc.send(Some(&key), 42).await;
    assert_eq!(
        (first.status, first.replayed),
        (201, false),
        "{}",
        first.text()
    );
    assert_eq!(first.not_stored.as_deref(), Some("first-response-only"));
    for _ in 0..5 {
        let retry = svc.send(Some(&key), 42).await;
        assert_eq!(retry.status, first.status);
        assert!(retry.replayed);
        assert_eq!(retry.body, first.body, "byte for byte");
        assert_eq!(retry.content_type, first.content_type);
        assert_eq!(retry.location, first.location);
        // Only the selected headers are stored.
        assert_eq!(retry.not_stored, None);
    }
    assert_eq!(svc.effects().await, 1);
    assert_eq!(svc.outbox_rows().await, 1);
    // And a new key is a new operation.
    let other = svc.send(Some(&new_key()), 42).await;
    assert_eq!((other.status, other.replayed), (201, false));
    assert_eq!(svc.outbox_rows().await, 2);
    svc.db.cleanup().await;
}
