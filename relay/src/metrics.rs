//! Prometheus metrics and the health endpoints.
//!
//! Names are constants so the dashboard and alert rules in `deploy/` can be
//! checked against them by the test suite.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use outbox_client::SchemaName;
use tokio_util::sync::CancellationToken;

use crate::engine::Stats;

/// Messages handled, by `destination` and `result` (`published`, `rejected`,
/// `dead_lettered`, `batch_failed`).
pub const MESSAGES: &str = "outbox_messages_total";
/// Seconds from a row's commit (its `created_at`) to the broker's confirm.
pub const COMMIT_TO_CONFIRM: &str = "outbox_commit_to_confirm_seconds";
/// Seconds one batch spent waiting for the broker.
pub const PUBLISH: &str = "outbox_publish_seconds";
/// Rows waiting, by `destination`.
pub const BACKLOG: &str = "outbox_backlog_messages";
/// Age of the oldest waiting row, by `destination`.
pub const OLDEST_PENDING: &str = "outbox_oldest_pending_seconds";
/// Rejected attempts that will be retried.
pub const RETRIES: &str = "outbox_retries_total";
/// Messages in the dead letters.
pub const DEAD_LETTERS: &str = "outbox_dead_letters";
/// Keys parked behind a dead letter.
pub const PARKED_KEYS: &str = "outbox_parked_keys";
/// Partitions this replica owns.
pub const PARTITIONS_OWNED: &str = "outbox_partitions_owned";
/// Partitions owned by no replica, as this replica last saw.
pub const PARTITIONS_UNOWNED: &str = "outbox_partitions_unowned";
/// 1 while the connection to `target` (`postgres`, `broker`) works.
pub const CONNECTION_UP: &str = "outbox_connection_up";
/// 1 while this replica is ready (see `/readyz`).
pub const READY: &str = "outbox_ready";

/// Published rows deleted by the retention cleanup (retention mode only).
pub const RETENTION_DELETED: &str = "outbox_retention_deleted_total";

/// Every metric the relay exports.
pub const ALL: &[&str] = &[
    MESSAGES,
    COMMIT_TO_CONFIRM,
    PUBLISH,
    BACKLOG,
    OLDEST_PENDING,
    RETRIES,
    DEAD_LETTERS,
    PARKED_KEYS,
    PARTITIONS_OWNED,
    PARTITIONS_UNOWNED,
    CONNECTION_UP,
    READY,
    RETENTION_DELETED,
];

/// Installs the Prometheus recorder for this process.
pub fn install() -> Result<PrometheusHandle, String> {
    let buckets = [
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ];
    PrometheusBuilder::new()
        .set_buckets(&buckets)
        .map_err(|e| e.to_string())?
        .install_recorder()
        .map_err(|e| e.to_string())
}

#[derive(Clone)]
struct AppState {
    handle: PrometheusHandle,
    stats: Arc<Stats>,
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `listener` until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    handle: PrometheusHandle,
    stats: Arc<Stats>,
    shutdown: CancellationToken,
) {
    let app = Router::new()
        .route(
            "/metrics",
            get(|State(s): State<AppState>| async move { s.handle.render() }),
        )
        // Alive: the process answers. Nothing else belongs here, or a broker
        // outage would get healthy relays restarted.
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(AppState { handle, stats });
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await;
    if let Err(e) = served {
        tracing::error!(error = %e, "http server failed");
    }
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

/// Binds the HTTP address, naming the flag on failure.
pub async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, crate::config::ConfigError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| crate::config::ConfigError {
            flag: "--http-addr",
            reason: format!("cannot listen on {addr}: {e}"),
        })
}

/// Refreshes the gauges that come from the database (backlog, oldest pending
/// age, dead letters, parked keys) and the readiness gauge, every `every`.
pub async fn collect(
    pg: crate::source::Database,
    schema: SchemaName,
    stats: Arc<Stats>,
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
    let mut client: Option<tokio_postgres::Client> = None;
    let mut seen: std::collections::HashSet<String> = std::collections::HashSet::new();
    loop {
        metrics::gauge!(READY).set(if stats.not_ready_reason().is_none() {
            1.0
        } else {
            0.0
        });
        metrics::gauge!(CONNECTION_UP, "target" => "postgres").set(
            if stats.postgres_up.load(Ordering::Relaxed) {
                1.0
            } else {
                0.0
            },
        );
        metrics::gauge!(CONNECTION_UP, "target" => "broker").set(
            if stats.broker_down().is_none() {
                1.0
            } else {
                0.0
            },
        );
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            client = crate::source::connect(&pg, Duration::from_secs(60))
                .await
                .ok();
        }
        if let Some(c) = &client {
            if let Ok(rows) = c.query(backlog_sql.as_str(), &[]).await {
                let mut now_seen = std::collections::HashSet::new();
                for r in rows {
                    let d: String = r.get(0);
                    metrics::gauge!(BACKLOG, "destination" => d.clone())
                        .set(r.get::<_, i64>(1) as f64);
                    metrics::gauge!(OLDEST_PENDING, "destination" => d.clone())
                        .set(r.get::<_, Option<f64>>(2).unwrap_or(0.0));
                    now_seen.insert(d);
                }
                // A drained destination reads 0, not its last value.
                for gone in seen.difference(&now_seen) {
                    metrics::gauge!(BACKLOG, "destination" => gone.clone()).set(0.0);
                    metrics::gauge!(OLDEST_PENDING, "destination" => gone.clone()).set(0.0);
                }
                seen.extend(now_seen);
            }
            if let Ok(r) = c.query_one(dead_sql.as_str(), &[]).await {
                metrics::gauge!(DEAD_LETTERS).set(r.get::<_, i64>(0) as f64);
            }
            if let Ok(r) = c.query_one(parked_sql.as_str(), &[]).await {
                metrics::gauge!(PARKED_KEYS).set(r.get::<_, i64>(0) as f64);
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}
