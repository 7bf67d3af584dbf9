//! A webhook receiver that applies each provider event once.
//!
//! Providers resend an event when they do not get a 2xx in time, and sometimes
//! when they did. Each event carries a stable id; recording it in the inbox in
//! the same transaction as the effect makes a resend harmless, and a recognized
//! resend is answered 200 like the first delivery (a 500 would make the provider
//! keep trying).
//!
//! ```sh
//! cargo run -p outbox-client --example webhook
//! curl -i localhost:3000/webhooks/payments -H 'content-type: application/json' \
//!   -d '{"id":"evt_1","type":"credit.granted","data":{"account":"acme","amount":100}}'
//! ```
//!
//! Environment: `DATABASE_URL` (default the local Postgres), `WEBHOOK_SCHEMA`
//! (default `outbox`), `WEBHOOK_ADDR` (default `127.0.0.1:3000`; port 0 picks a
//! free one). The bound address is printed on stdout.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use outbox_client::inbox::{Arrival, Inbox};
use outbox_client::SchemaName;
use serde::Deserialize;
use tokio_postgres::{Client, Config, NoTls};

/// The provider's event, as most providers shape it: an id, a type, a body.
#[derive(Debug, Deserialize)]
struct Event {
    id: String,
    #[serde(rename = "type")]
    kind: String,
    data: Credit,
}

#[derive(Debug, Deserialize)]
struct Credit {
    account: String,
    amount: i64,
}

struct App {
    config: Config,
    inbox: Inbox,
    accounts: String,
}

/// Inbox consumer name: one per provider endpoint.
const CONSUMER: &str = "payments-webhook";

async fn receive(
    State(app): State<Arc<App>>,
    Json(event): Json<Event>,
) -> Result<(StatusCode, &'static str), (StatusCode, &'static str)> {
    // A real endpoint verifies the provider's signature over the raw body first.
    let outcome = apply(&app, &event).await.map_err(|e| {
        eprintln!("event {} failed: {e}", event.id);
        // A real failure: let the provider retry.
        (StatusCode::INTERNAL_SERVER_ERROR, "error\n")
    })?;
    Ok(match outcome {
        Arrival::New => (StatusCode::OK, "applied\n"),
        Arrival::Duplicate => (StatusCode::OK, "duplicate\n"),
    })
}

async fn apply(app: &App, event: &Event) -> Result<Arrival, Box<dyn std::error::Error>> {
    // One connection per request keeps the example small; use a pool in a service.
    let mut client = connect(&app.config).await?;
    let tx = client.transaction().await?;
    let outcome = app.inbox.process_once(&tx, CONSUMER, &event.id).await?;
    if outcome == Arrival::New && event.kind == "credit.granted" {
        tx.execute(
            &format!(
                "INSERT INTO {} (account, credits) VALUES ($1, $2) \
                 ON CONFLICT (account) DO UPDATE SET credits = {0}.credits + EXCLUDED.credits",
                app.accounts
            ),
            &[&event.data.account, &event.data.amount],
        )
        .await?;
    }
    // The id and the effect commit together, or neither does.
    tx.commit().await?;
    Ok(outcome)
}

async fn connect(config: &Config) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = config.connect(NoTls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            eprintln!("postgres connection: {e}");
        }
    });
    Ok(client)
}

fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/webhooks/payments", post(receive))
        .with_state(app)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let schema = SchemaName::new(
        &std::env::var("WEBHOOK_SCHEMA").unwrap_or_else(|_| SchemaName::DEFAULT.to_owned()),
    )?;
    let addr: SocketAddr = std::env::var("WEBHOOK_ADDR")
        .unwrap_or_else(|_| "127.0.0.1:3000".to_owned())
        .parse()?;
    let config: Config = url.parse()?;

    let mut client = connect(&config).await?;
    outbox_client::migrate(&mut client, schema.as_str()).await?;
    // The example's own domain table, next to the inbox.
    let accounts = format!("{}.webhook_accounts", schema.quoted());
    client
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS {accounts} (account text PRIMARY KEY, credits bigint NOT NULL)"
        ))
        .await?;
    drop(client);

    let app = Arc::new(App {
        config,
        inbox: Inbox::with_schema(schema),
        accounts,
    });
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!("listening on {}", listener.local_addr()?);
    axum::serve(listener, router(app)).await?;
    Ok(())
}
