//! The HTTP endpoints (`/metrics`, `/healthz`, `/readyz`) and the task that
//! keeps this replica's gauges and, on one replica, the database-wide ones
//! fresh.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use outbox_client::SchemaName;
use tokio_util::sync::CancellationToken;

use crate::health::Stats;
use crate::metrics::{destination_label, DbGauges, CONNECTION_UP, DATABASE_GAUGES, READY};
use crate::source::inspect;

#[derive(Clone)]
struct AppState {
    handle: PrometheusHandle,
    stats: Arc<Stats>,
    db: SharedDbGauges,
}

/// Where [`collect`] leaves the database-wide gauges for [`serve`]: `None`
/// while another replica exports them.
pub type SharedDbGauges = Arc<std::sync::Mutex<Option<DbGauges>>>;

/// Serves `/metrics`, `/healthz` and `/readyz` on `listener` until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    handle: PrometheusHandle,
    stats: Arc<Stats>,
    db: SharedDbGauges,
    shutdown: CancellationToken,
) {
    let app = Router::new()
        .route("/metrics", get(render))
        // Alive: the process answers. Nothing else belongs here, or a broker
        // outage would get healthy relays restarted.
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(AppState { handle, stats, db });
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await;
    if let Err(e) = served {
        tracing::error!(error = %e, "http server failed");
    }
}

async fn render(State(s): State<AppState>) -> String {
    let mut out = s.handle.render();
    if let Some(db) = s.db.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
        out.push_str(&db.render());
    }
    out
}

async fn readyz(State(s): State<AppState>) -> (StatusCode, String) {
    match s.stats.not_ready_reason() {
        None => (StatusCode::OK, "ready\n".into()),
        Some(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        ),
    }
}

/// Binds the HTTP address.
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}

/// Every `every`: sets this replica's gauges (readiness, connections) and,
/// on the one replica that holds the schema's metrics lock, reads the
/// database-wide ones (backlog, oldest pending age, dead letters, parked
/// keys) into `db`. When the holder goes away, its session's lock goes
/// with it and another replica takes over within one interval.
///
/// Counting the backlog reads every waiting row, so a large backlog makes
/// the read slow; the next one then waits 20 times as long as this one took
/// (at least `every`), which keeps the gauges under 5 % of one database
/// core however large the backlog grows.
pub async fn collect(
    pg: crate::source::Database,
    schema: SchemaName,
    stats: Arc<Stats>,
    db: SharedDbGauges,
    park: bool,
    every: Duration,
    shutdown: CancellationToken,
) {
    // A read or connect waiting on a server that answers nothing is
    // dropped at shutdown, not waited out to its bound.
    let collecting = collect_until(pg, schema, stats, db, park, every, shutdown.clone());
    shutdown.run_until_cancelled(collecting).await;
}

async fn collect_until(
    pg: crate::source::Database,
    schema: SchemaName,
    stats: Arc<Stats>,
    db: SharedDbGauges,
    park: bool,
    every: Duration,
    shutdown: CancellationToken,
) {
    // The exporter's lock key, read once per session.
    let lock_sql = "SELECT pg_try_advisory_lock($1)";
    let mut key: Option<i64> = None;
    let mut client: Option<crate::source::Session> = None;
    // The session's statement_timeout is 30 s: past a minute, nothing is
    // answering, and the session is given up (see `source::answered`).
    let bound = Duration::from_secs(60);
    let mut unanswered = false;
    let mut holding = false;
    let mut seen: std::collections::BTreeSet<String> = std::collections::BTreeSet::new();
    let mut next_read = tokio::time::Instant::now();
    loop {
        metrics::gauge!(READY).set(if stats.not_ready_reason().is_none() {
            1.0
        } else {
            0.0
        });
        metrics::gauge!(CONNECTION_UP, "target" => "postgres").set(if stats.postgres_up() {
            1.0
        } else {
            0.0
        });
        metrics::gauge!(CONNECTION_UP, "target" => "broker").set(
            if stats.broker_down().is_none() {
                1.0
            } else {
                0.0
            },
        );
        if unanswered || client.as_ref().is_none_or(|c| c.is_closed()) {
            holding = false;
            unanswered = false;
            // Closes a given-up session's socket before opening another.
            drop(client.take());
            key = None;
            client = crate::source::connect(&pg, Duration::from_secs(60))
                .await
                .ok();
        }
        let due = tokio::time::Instant::now() >= next_read;
        let mut snapshot = None;
        if let Some(c) = &client {
            if key.is_none() {
                let read = c
                    .answered(bound, crate::source::ownership::exporter_key(c, &schema))
                    .await;
                unanswered = is_unanswered(&read);
                key = read.ok();
            }
            if let (false, Some(k)) = (holding, key) {
                let locked = c.answered(bound, c.query_one(lock_sql, &[&k])).await;
                unanswered = is_unanswered(&locked);
                holding = locked.is_ok_and(|r| r.get::<_, bool>(0));
            }
            if holding && !due {
                // Between reads: the last reading stands.
                snapshot = db.lock().unwrap_or_else(|p| p.into_inner()).take();
            } else if holding {
                let started = tokio::time::Instant::now();
                let read = c.answered(bound, read_db_gauges(c, &schema, park)).await;
                unanswered = is_unanswered(&read);
                let took = started.elapsed();
                next_read = started + every.max(took * 20);
                snapshot = match read {
                    Ok(g) => Some(g),
                    Err(e) if took * 20 > every => {
                        // A slow failure puts the next read off for longer
                        // than an interval: said, or the gauges would vanish
                        // for minutes with no trace of why (most often a
                        // backlog so large that counting it outlasts the
                        // session's statement timeout). A quick one is tried
                        // again at the next interval, and the relay's own
                        // sessions report what ails Postgres.
                        tracing::warn!(
                            error = %e,
                            took = ?took,
                            next_in = ?next_read.saturating_duration_since(tokio::time::Instant::now()),
                            "reading the database gauges (backlog, oldest pending, dead letters) failed; they are not exported until the next read"
                        );
                        None
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "reading the database gauges failed; trying again at the next interval");
                        None
                    }
                };
                if let Some(g) = snapshot.as_mut() {
                    // A drained destination reads 0, not nothing.
                    for gone in &seen {
                        g.backlog.entry(gone.clone()).or_insert((0.0, 0.0));
                    }
                    seen.extend(g.backlog.keys().cloned());
                }
            }
        }
        metrics::gauge!(DATABASE_GAUGES).set(if snapshot.is_some() { 1.0 } else { 0.0 });
        *db.lock().unwrap_or_else(|p| p.into_inner()) = snapshot;
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

/// The session got no answer, or was given up with one that got none.
fn is_unanswered<T>(done: &Result<T, crate::source::PgFault>) -> bool {
    done.as_ref().is_err_and(crate::source::PgFault::gave_up)
}

async fn read_db_gauges(
    c: &tokio_postgres::Client,
    schema: &SchemaName,
    park: bool,
) -> Result<DbGauges, tokio_postgres::Error> {
    let mut g = DbGauges::default();
    for b in inspect::backlog(c, schema).await? {
        let e = g
            .backlog
            .entry(destination_label(&b.destination))
            .or_insert((0.0, 0.0));
        e.0 += b.pending as f64;
        e.1 = e.1.max(b.oldest_age_s.unwrap_or(0.0));
    }
    g.dead_letters = inspect::dead_letter_count(c, schema).await? as f64;
    // Under `--dead-letter-order skip` a dead letter holds nothing back.
    if park {
        g.parked_keys = inspect::parked_key_count(c, schema).await? as f64;
    }
    Ok(g)
}
