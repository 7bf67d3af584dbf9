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
pub async fn collect(
    pg: crate::source::Database,
    schema: SchemaName,
    stats: Arc<Stats>,
    db: SharedDbGauges,
    every: Duration,
    shutdown: CancellationToken,
) {
    let s = schema.quoted();
    let backlog_sql = format!(
        "SELECT destination, count(*), extract(epoch FROM now() - min(created_at))::float8 \
         FROM {s}.messages GROUP BY destination"
    );
    let dead_sql = format!("SELECT count(*) FROM {s}.dead_letters");
    let parked_sql = format!(
        "SELECT count(DISTINCT d.ordering_key) FROM {s}.dead_letters d \
         WHERE EXISTS (SELECT 1 FROM {s}.messages m WHERE m.ordering_key = d.ordering_key AND m.seq > d.seq)"
    );
    let lock_sql = "SELECT pg_try_advisory_lock(hashtext('outbox-metrics:' || $1))";
    let mut client: Option<tokio_postgres::Client> = None;
    let mut holding = false;
    let mut seen: std::collections::BTreeSet<String> = std::collections::BTreeSet::new();
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
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            holding = false;
            client = crate::source::connect(&pg, Duration::from_secs(60))
                .await
                .ok();
        }
        let mut snapshot = None;
        if let Some(c) = &client {
            if !holding {
                holding = c
                    .query_one(lock_sql, &[&schema.as_str()])
                    .await
                    .is_ok_and(|r| r.get::<_, bool>(0));
            }
            if holding {
                snapshot = read_db_gauges(c, &backlog_sql, &dead_sql, &parked_sql)
                    .await
                    .ok();
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

async fn read_db_gauges(
    c: &tokio_postgres::Client,
    backlog_sql: &str,
    dead_sql: &str,
    parked_sql: &str,
) -> Result<DbGauges, tokio_postgres::Error> {
    let mut g = DbGauges::default();
    for r in c.query(backlog_sql, &[]).await? {
        let label = destination_label(r.get::<_, &str>(0));
        let e = g.backlog.entry(label).or_insert((0.0, 0.0));
        e.0 += r.get::<_, i64>(1) as f64;
        e.1 = e.1.max(r.get::<_, Option<f64>>(2).unwrap_or(0.0));
    }
    g.dead_letters = c.query_one(dead_sql, &[]).await?.get::<_, i64>(0) as f64;
    g.parked_keys = c.query_one(parked_sql, &[]).await?.get::<_, i64>(0) as f64;
    Ok(g)
}
