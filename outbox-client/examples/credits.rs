//! `POST /credits`, made idempotent: the timeout that succeeded.
//!
//! A client calls `POST /credits` with a 5 s timeout; the handler takes 6 s.
//! The client gives up at 5 s and retries with the same `Idempotency-Key`.
//! Without a key the credits would be granted twice. Here the first request
//! keeps running (it is spawned, so the client hanging up does not cancel it),
//! commits its grant, its outbox message and its response in one transaction;
//! the retry waits for it and gets that response back, marked
//! `Idempotent-Replayed: true`. The credits are granted once.
//!
//! ```sh
//! cargo run -p outbox-client --features axum --example credits
//! CREDITS_HANDLER_DELAY_MS=600 CREDITS_CLIENT_TIMEOUT_MS=500 \
//!     cargo run -p outbox-client --features axum --example credits   # the same story, fast
//! ```
//!
//! `OUTBOX_DATABASE_URL` (default the local Postgres) and `OUTBOX_SCHEMA`
//! (default `outbox`) pick the database; the example migrates the schema and
//! keeps its two tables next to the outbox for brevity. It exits non-zero if
//! the credits were not granted exactly once or the retry did not get the
//! original response.

use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use outbox_client::idempotency::axum::{IdempotentRequest, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED};
use outbox_client::idempotency::{Idempotency, WhenInProgress};
use outbox_client::{Message, Outbox, SchemaName};
use serde::{Deserialize, Serialize};
use tokio_postgres::NoTls;

/// The story's two delays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delays {
    /// How long the handler works before granting.
    pub handler: Duration,
    /// How long the client waits for an answer.
    pub client_timeout: Duration,
}

impl Delays {
    /// The story as told: a 6 s handler, a 5 s client timeout.
    pub const STORY: Delays = Delays {
        handler: Duration::from_secs(6),
        client_timeout: Duration::from_secs(5),
    };

    /// Reads `CREDITS_HANDLER_DELAY_MS` and `CREDITS_CLIENT_TIMEOUT_MS` through
    /// `lookup`, each defaulting to [`Delays::STORY`].
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Delays, String> {
        let ms = |name: &str, default: Duration| match lookup(name) {
            None => Ok(default),
            Some(v) => v
                .trim()
                .parse::<u64>()
                .map(Duration::from_millis)
                .map_err(|e| format!("{name}={v:?} is not a number of milliseconds: {e}")),
        };
        Ok(Delays {
            handler: ms("CREDITS_HANDLER_DELAY_MS", Delays::STORY.handler)?,
            client_timeout: ms("CREDITS_CLIENT_TIMEOUT_MS", Delays::STORY.client_timeout)?,
        })
    }
}

/// The service's shared state.
#[derive(Clone)]
pub struct App {
    pool: Pool,
    idempotency: Idempotency,
    outbox: Outbox,
    accounts: String,
    grants: String,
    handler_delay: Duration,
}

impl App {
    /// A service on `schema` (migrated, with [`create_tables`] run).
    pub fn new(pool: Pool, schema: SchemaName, handler_delay: Duration) -> App {
        App {
            pool,
            // A double click or a retry that overlaps the original waits for it
            // and gets its response, rather than a 409. The bound keeps a stuck
            // original from holding every retry's connection.
            idempotency: Idempotency::with_schema(schema.clone())
                .when_in_progress(WhenInProgress::Wait(Duration::from_secs(10))),
            outbox: Outbox::with_schema(schema.clone()),
            accounts: format!("{}.credit_accounts", schema.quoted()),
            grants: format!("{}.credit_grants", schema.quoted()),
            handler_delay,
        }
    }
}

/// A deadpool of connections for `config`.
pub fn pool(config: tokio_postgres::Config) -> Result<Pool, deadpool_postgres::BuildError> {
    let manager = Manager::from_config(
        config,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager).max_size(16).build()
}

/// The example's own tables, next to the outbox in `schema`.
pub async fn create_tables(
    client: &tokio_postgres::Client,
    schema: &SchemaName,
) -> Result<(), tokio_postgres::Error> {
    client
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS {s}.credit_accounts (
                 user_id text PRIMARY KEY,
                 credits bigint NOT NULL
             );
             CREATE TABLE IF NOT EXISTS {s}.credit_grants (
                 grant_id   uuid PRIMARY KEY,
                 user_id    text NOT NULL,
                 amount     bigint NOT NULL,
                 granted_at timestamptz NOT NULL DEFAULT now()
             );",
            s = schema.quoted()
        ))
        .await
}

/// `POST /credits`.
pub fn router(app: App) -> Router {
    Router::new()
        .route("/credits", post(grant_credits))
        .with_state(app)
}

/// Serves `app` on an ephemeral local port.
pub async fn serve(app: App) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router(app)).await {
            eprintln!("server stopped: {e}");
        }
    });
    Ok((addr, server))
}

#[derive(Debug, Deserialize)]
struct GrantRequest {
    amount: i64,
}

/// The response body of a grant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    /// Made by the handler, so a replay shows which execution it came from.
    pub grant_id: uuid::Uuid,
    /// Who got the credits.
    pub user: String,
    /// How many.
    pub amount: i64,
    /// The balance after the grant.
    pub balance: i64,
}

/// A database failure inside the handler: logged, answered 500, rolled back.
struct Internal(String);

impl<E: std::error::Error> From<E> for Internal {
    fn from(e: E) -> Self {
        Internal(e.to_string())
    }
}

impl IntoResponse for Internal {
    fn into_response(self) -> Response {
        eprintln!("grant failed: {}", self.0);
        (StatusCode::INTERNAL_SERVER_ERROR, "internal error").into_response()
    }
}

async fn grant_credits(
    State(app): State<App>,
    headers: HeaderMap,
    request: IdempotentRequest,
) -> Response {
    // Stands in for authentication: the scope must name the principal, so one
    // user's key can never replay another user's response.
    let Some(user) = headers.get("x-user").and_then(|v| v.to_str().ok()) else {
        return (StatusCode::UNAUTHORIZED, "missing x-user header").into_response();
    };
    let user = user.to_owned();
    let amount = match serde_json::from_slice::<GrantRequest>(request.body()) {
        Ok(GrantRequest { amount }) if amount > 0 => amount,
        Ok(_) => return (StatusCode::BAD_REQUEST, "amount must be positive").into_response(),
        Err(e) => return (StatusCode::BAD_REQUEST, format!("bad body: {e}")).into_response(),
    };
    let scope = format!("user:{user} POST /credits");

    // Spawned so that a client hanging up at its timeout does not cancel the
    // request halfway: it finishes, commits, and its response waits for the
    // retry. (Cancelled instead, it would roll back and the retry would run it
    // again: also granted once, but the work is lost.)
    let task = tokio::spawn(async move {
        let mut client = match app.pool.get().await {
            Ok(client) => client,
            Err(e) => {
                eprintln!("no database connection: {e}");
                return StatusCode::SERVICE_UNAVAILABLE.into_response();
            }
        };
        let App {
            idempotency,
            outbox,
            accounts,
            grants,
            handler_delay,
            ..
        } = app;
        idempotency
            .respond(&mut client, &scope, &request, move |tx| {
                Box::pin(async move {
                    tokio::time::sleep(handler_delay).await; // the slow part
                    let balance: i64 = tx
                        .query_one(
                            &format!(
                                "INSERT INTO {accounts} (user_id, credits) VALUES ($1, $2) \
                                 ON CONFLICT (user_id) DO UPDATE \
                                   SET credits = {accounts}.credits + excluded.credits \
                                 RETURNING credits"
                            ),
                            &[&user, &amount],
                        )
                        .await?
                        .try_get(0)?;
                    let grant = Grant {
                        grant_id: uuid::Uuid::now_v7(),
                        user,
                        amount,
                        balance,
                    };
                    tx.execute(
                        &format!(
                            "INSERT INTO {grants} (grant_id, user_id, amount) VALUES ($1, $2, $3)"
                        ),
                        &[&grant.grant_id, &grant.user, &grant.amount],
                    )
                    .await?;
                    outbox
                        .enqueue(
                            tx,
                            &Message::builder("credits")
                                .key(grant.user.as_str())
                                .routing_key("credits.granted")
                                .json(&grant)
                                .build()?,
                        )
                        .await?;
                    Ok::<_, Internal>((StatusCode::CREATED, Json(grant)))
                })
            })
            .await
    });
    task.await
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// What one client attempt saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    /// No answer within the client timeout.
    TimedOut,
    /// An answer.
    Answered {
        /// HTTP status.
        status: u16,
        /// Whether `Idempotent-Replayed: true` was set.
        replayed: bool,
        /// The body.
        body: Vec<u8>,
    },
}

/// The client's side: one key for the operation, the same key on every
/// attempt; retries after a timeout at once, after a 409 when `Retry-After`
/// says; stops at the first other answer or after `max_attempts`.
pub async fn client_story(
    base: &str,
    user: &str,
    amount: i64,
    timeout: Duration,
    max_attempts: usize,
) -> Result<Vec<Attempt>, reqwest::Error> {
    let http = reqwest::Client::builder().timeout(timeout).build()?;
    let key = uuid::Uuid::new_v4().to_string();
    let body = serde_json::json!({ "amount": amount }).to_string();
    let mut attempts = Vec::new();
    while attempts.len() < max_attempts {
        let sent = http
            .post(format!("{base}/credits"))
            .header(IDEMPOTENCY_KEY.as_str(), &key)
            .header("x-user", user)
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await;
        let response = match sent {
            Err(e) if e.is_timeout() => {
                attempts.push(Attempt::TimedOut);
                continue;
            }
            Err(e) => return Err(e),
            Ok(response) => response,
        };
        let status = response.status().as_u16();
        let replayed = response
            .headers()
            .get(IDEMPOTENT_REPLAYED.as_str())
            .is_some_and(|v| v == "true");
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let body = match response.bytes().await {
            Ok(bytes) => bytes.to_vec(),
            Err(e) if e.is_timeout() => {
                attempts.push(Attempt::TimedOut);
                continue;
            }
            Err(e) => return Err(e),
        };
        attempts.push(Attempt::Answered {
            status,
            replayed,
            body,
        });
        if status != 409 {
            break;
        }
        tokio::time::sleep(Duration::from_secs(retry_after.unwrap_or(1))).await;
    }
    Ok(attempts)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let delays = Delays::from_lookup(|name| std::env::var(name).ok())?;
    let url = std::env::var("OUTBOX_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let schema = SchemaName::new(
        &std::env::var("OUTBOX_SCHEMA").unwrap_or_else(|_| SchemaName::DEFAULT.to_owned()),
    )?;
    let config = tokio_postgres::Config::from_str(&url)?;

    let (mut client, connection) = config.connect(NoTls).await?;
    tokio::spawn(connection);
    outbox_client::migrate(&mut client, schema.as_str()).await?;
    create_tables(&client, &schema).await?;

    let (addr, _server) = serve(App::new(pool(config)?, schema.clone(), delays.handler)).await?;
    let user = format!("user-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    println!(
        "POST /credits for {user}: handler takes {:?}, client times out after {:?}",
        delays.handler, delays.client_timeout
    );

    let attempts = client_story(
        &format!("http://{addr}"),
        &user,
        100,
        delays.client_timeout,
        5,
    )
    .await?;
    for (n, attempt) in attempts.iter().enumerate() {
        match attempt {
            Attempt::TimedOut => println!("attempt {}: timed out", n + 1),
            Attempt::Answered {
                status,
                replayed,
                body,
            } => println!(
                "attempt {}: {status}{} {}",
                n + 1,
                if *replayed { " (replayed)" } else { "" },
                String::from_utf8_lossy(body)
            ),
        }
    }

    let grants = client
        .query(
            &format!(
                "SELECT grant_id FROM {}.credit_grants WHERE user_id = $1",
                schema.quoted()
            ),
            &[&user],
        )
        .await?;
    let balance: i64 = client
        .query_one(
            &format!(
                "SELECT credits FROM {}.credit_accounts WHERE user_id = $1",
                schema.quoted()
            ),
            &[&user],
        )
        .await?
        .try_get(0)?;
    println!(
        "grants in the database: {}, balance: {balance}",
        grants.len()
    );

    let original: Option<uuid::Uuid> = grants.first().map(|row| row.get(0));
    let answered = attempts.iter().rev().find_map(|a| match a {
        Attempt::Answered {
            status: 201, body, ..
        } => serde_json::from_slice::<Grant>(body).ok(),
        _ => None,
    });
    if grants.len() != 1 || balance != 100 {
        return Err(format!("credits granted {} times", grants.len()).into());
    }
    match answered {
        Some(grant) if Some(grant.grant_id) == original => {
            println!("granted once; the client got the original response");
            Ok(())
        }
        other => Err(format!("client ended with {other:?}, not the original grant").into()),
    }
}
