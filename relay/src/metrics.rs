//! Prometheus metrics: names, HELP text, bounded labels and the recorder.
//! Everything that records a metric uses these names; the HTTP side lives in
//! [`crate::endpoints`].
//!
//! Names are constants so the dashboard and alert rules in `deploy/` can be
//! checked against them by the test suite.

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Messages handled, by `destination` and `result` (`published`,
/// `rejected`, `dead_lettered`). A `rejected` message counts once per
/// attempt; whole batches that failed are [`BATCH_FAILURES`].
pub const MESSAGES: &str = "outbox_messages_total";
/// Batches that failed as a whole (broker unreachable, no confirm in time):
/// their rows stay in the outbox and go out again, with no attempt counted.
pub const BATCH_FAILURES: &str = "outbox_batch_failures_total";
/// Seconds from a row's `created_at` (the start of the transaction that
/// wrote it) to the broker's confirm, before the relay's settle.
pub const COMMIT_TO_CONFIRM: &str = "outbox_commit_to_confirm_seconds";
/// Seconds one batch spent waiting for the broker.
pub const PUBLISH: &str = "outbox_publish_seconds";
/// Seconds one claim statement took, whether it found rows or not.
pub const CLAIM: &str = "outbox_claim_seconds";
/// Seconds one claim kept the next one waiting: from its start until its
/// rows were locked (see `source::claim`).
pub const CLAIM_LOCKING: &str = "outbox_claim_locking_seconds";
/// Seconds one published batch's settle took: its rows' updates and the
/// commit, in one round trip.
pub const SETTLE: &str = "outbox_settle_seconds";
/// Seconds a claimed batch waited for its rows' commits to become durable
/// before its publish (see `source::durable`).
pub const DURABLE_WAIT: &str = "outbox_durable_wait_seconds";
/// Rows waiting, by `destination` (database-wide; one replica exports it).
pub const BACKLOG: &str = "outbox_backlog_messages";
/// Age of the oldest waiting row, by `destination` (database-wide).
pub const OLDEST_PENDING: &str = "outbox_oldest_pending_seconds";
/// Rejected attempts that will be retried.
pub const RETRIES: &str = "outbox_retries_total";
/// Messages in the dead letters (database-wide).
pub const DEAD_LETTERS: &str = "outbox_dead_letter_messages";
/// Keys parked behind a dead letter (database-wide).
pub const PARKED_KEYS: &str = "outbox_parked_keys";
/// Partitions this replica owns.
pub const PARTITIONS_OWNED: &str = "outbox_partitions_owned";
/// Partitions owned by no replica, as this replica last saw.
pub const PARTITIONS_UNOWNED: &str = "outbox_partitions_unowned";
/// 1 while the connection to `target` (`postgres`, `broker`) works.
pub const CONNECTION_UP: &str = "outbox_connection_up";
/// 1 while this replica is ready (see `/readyz`).
pub const READY: &str = "outbox_ready";
/// Always 1; `version` and `broker` label the running build.
pub const BUILD_INFO: &str = "outbox_build_info";
/// 1 on the one replica that exports the database-wide gauges.
pub const DATABASE_GAUGES: &str = "outbox_database_gauges_exporter";

/// Published rows deleted by the retention cleanup (retention mode only).
pub const RETENTION_DELETED: &str = "outbox_retention_deleted_total";
/// Kafka partitions whose records this replica holds back unsent: they left
/// records unanswered while the rest of their topic answered (always 0 on
/// RabbitMQ).
pub const KAFKA_SILENT_PARTITIONS: &str = "outbox_kafka_silent_partitions";

/// Every metric the relay exports. The database-wide ones
/// ([`DATABASE_WIDE`]) appear on one replica at a time.
pub const ALL: &[&str] = &[
    MESSAGES,
    BATCH_FAILURES,
    COMMIT_TO_CONFIRM,
    PUBLISH,
    CLAIM,
    CLAIM_LOCKING,
    SETTLE,
    DURABLE_WAIT,
    BACKLOG,
    OLDEST_PENDING,
    RETRIES,
    DEAD_LETTERS,
    PARKED_KEYS,
    PARTITIONS_OWNED,
    PARTITIONS_UNOWNED,
    CONNECTION_UP,
    READY,
    BUILD_INFO,
    DATABASE_GAUGES,
    RETENTION_DELETED,
    KAFKA_SILENT_PARTITIONS,
];

/// Gauges that describe the whole outbox rather than one replica: only the
/// replica holding the schema's metrics lock exports them, so a sum across
/// replicas is right and a dashboard never counts the backlog twice.
pub const DATABASE_WIDE: &[&str] = &[BACKLOG, OLDEST_PENDING, DEAD_LETTERS, PARKED_KEYS];

/// HELP text of each metric, with its unit where Prometheus has one.
const HELP: &[(&str, &str)] = &[
    (MESSAGES, "Messages handled, by destination and result (published, rejected, dead_lettered); a rejection counts per attempt."),
    (BATCH_FAILURES, "Batches that failed as a whole (broker unreachable or no confirm in time); their rows are published again and no attempt is counted."),
    (COMMIT_TO_CONFIRM, "Seconds from a row's created_at (the start of the transaction that wrote it) to the broker's confirm."),
    (PUBLISH, "Seconds one batch spent waiting for the broker's answers."),
    (CLAIM, "Seconds one claim statement took in Postgres, round trip included, whether it found rows or not; claims are taken one at a time per replica."),
    (CLAIM_LOCKING, "Seconds from a claim's start until its rows were locked, the part of it the next claim of the replica waits for; near the drain's whole time, claims follow one another."),
    (SETTLE, "Seconds one published batch's settle took in Postgres: deleting (or moving) its confirmed rows, recording refusals, and the commit, in one round trip."),
    (DURABLE_WAIT, "Seconds a claimed batch waited, before its publish, for its rows' commits to be flushed and on the synchronous standbys; a batch that waited half the hold limit went back unpublished."),
    (BACKLOG, "Messages waiting in the outbox, by destination (database-wide, from one replica)."),
    (OLDEST_PENDING, "Age in seconds of the oldest waiting message, by destination (database-wide, from one replica)."),
    (RETRIES, "Rejected attempts that will be retried."),
    (DEAD_LETTERS, "Messages in the dead letters (database-wide, from one replica)."),
    (PARKED_KEYS, "Ordering keys whose later messages wait behind a dead letter (database-wide, from one replica)."),
    (PARTITIONS_OWNED, "Outbox partitions this replica owns."),
    (PARTITIONS_UNOWNED, "Outbox partitions owned by no replica, as this replica last saw."),
    (CONNECTION_UP, "1 while this replica's connection to target (postgres, broker) works."),
    (READY, "1 while this replica is ready (Postgres reachable and part of the replica set); the broker is not part of it."),
    (BUILD_INFO, "Always 1; the version and broker labels name the running build."),
    (DATABASE_GAUGES, "1 on the replica that exports the database-wide gauges, 0 on the others."),
    (RETENTION_DELETED, "Published rows deleted by the retention cleanup."),
    (KAFKA_SILENT_PARTITIONS, "Kafka partitions whose records this replica holds back unsent, because they left records unanswered while the rest of their topic answered; one batch per message timeout tries each again (0 on RabbitMQ)."),
];

/// Most distinct `destination` label values one process exports; later
/// destinations are counted under [`OTHER_DESTINATIONS`], so a producer that
/// invents topic names cannot grow the series without bound.
pub const MAX_DESTINATION_LABELS: usize = 200;
/// The `destination` label of destinations past [`MAX_DESTINATION_LABELS`].
pub const OTHER_DESTINATIONS: &str = "_other";
/// The `destination` label of AMQP's default exchange (whose name is empty,
/// which Prometheus would read as no label at all).
pub const DEFAULT_EXCHANGE_LABEL: &str = "amq.default";

static DESTINATIONS: std::sync::Mutex<Option<std::collections::HashSet<String>>> =
    std::sync::Mutex::new(None);

/// The `destination` label value for `destination`, bounded (see
/// [`MAX_DESTINATION_LABELS`]).
pub fn destination_label(destination: &str) -> String {
    let mut seen = DESTINATIONS.lock().unwrap_or_else(|p| p.into_inner());
    let seen = seen.get_or_insert_with(Default::default);
    bounded_label(seen, destination, MAX_DESTINATION_LABELS)
}

fn bounded_label(
    seen: &mut std::collections::HashSet<String>,
    destination: &str,
    cap: usize,
) -> String {
    let name = if destination.is_empty() {
        DEFAULT_EXCHANGE_LABEL
    } else {
        destination
    };
    if seen.contains(name) {
        return name.to_owned();
    }
    if seen.len() < cap {
        seen.insert(name.to_owned());
        return name.to_owned();
    }
    OTHER_DESTINATIONS.to_owned()
}

/// Installs the Prometheus recorder for this process, with HELP text for
/// every metric and the build info series.
pub fn install(broker: &'static str) -> Result<PrometheusHandle, String> {
    let buckets = [
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ];
    let handle = PrometheusBuilder::new()
        .set_buckets(&buckets)
        .map_err(|e| e.to_string())?
        .install_recorder()
        .map_err(|e| e.to_string())?;
    for (name, help) in HELP {
        if DATABASE_WIDE.contains(name) {
            continue; // rendered by hand, see DbGauges
        }
        if name.ends_with("_total") {
            metrics::describe_counter!(*name, *help);
        } else if name.ends_with("_seconds") {
            metrics::describe_histogram!(*name, metrics::Unit::Seconds, *help);
        } else {
            metrics::describe_gauge!(*name, *help);
        }
    }
    metrics::gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION"), "broker" => broker)
        .set(1.0);
    metrics::counter!(BATCH_FAILURES).increment(0);
    metrics::gauge!(DATABASE_GAUGES).set(0.0);
    metrics::gauge!(KAFKA_SILENT_PARTITIONS).set(0.0);
    Ok(handle)
}

fn help(name: &str) -> &'static str {
    HELP.iter().find(|(n, _)| *n == name).map_or("", |(_, h)| h)
}

/// The database-wide gauges as last read, while this replica holds the
/// schema's metrics lock; rendered after the recorder's own output.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct DbGauges {
    /// Per destination label: (waiting, oldest age in seconds).
    pub backlog: std::collections::BTreeMap<String, (f64, f64)>,
    /// Dead letters.
    pub dead_letters: f64,
    /// Parked keys.
    pub parked_keys: f64,
}

impl DbGauges {
    /// Prometheus text exposition of these gauges.
    pub fn render(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let mut family = |name: &str, samples: Vec<(Option<&str>, f64)>| {
            let _ = writeln!(out, "# HELP {name} {}", help(name));
            let _ = writeln!(out, "# TYPE {name} gauge");
            for (dest, v) in samples {
                match dest {
                    Some(d) => {
                        let _ = writeln!(out, "{name}{{destination=\"{}\"}} {v}", escape_label(d));
                    }
                    None => {
                        let _ = writeln!(out, "{name} {v}");
                    }
                }
            }
        };
        family(
            BACKLOG,
            self.backlog
                .iter()
                .map(|(d, v)| (Some(d.as_str()), v.0))
                .collect(),
        );
        family(
            OLDEST_PENDING,
            self.backlog
                .iter()
                .map(|(d, v)| (Some(d.as_str()), v.1))
                .collect(),
        );
        family(DEAD_LETTERS, vec![(None, self.dead_letters)]);
        family(PARKED_KEYS, vec![(None, self.parked_keys)]);
        out
    }
}

/// Escapes a label value for the text format: backslash, quote, newline.
fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destination_labels_are_bounded_and_never_empty() {
        let mut seen = std::collections::HashSet::new();
        assert_eq!(bounded_label(&mut seen, "", 2), DEFAULT_EXCHANGE_LABEL);
        assert_eq!(bounded_label(&mut seen, "orders", 2), "orders");
        assert_eq!(bounded_label(&mut seen, "invoices", 2), OTHER_DESTINATIONS);
        assert_eq!(bounded_label(&mut seen, "orders", 2), "orders");
        assert_eq!(seen.len(), 2);
    }

    #[test]
    fn database_gauges_render_as_valid_exposition() {
        let mut g = DbGauges::default();
        g.backlog.insert("a\"b".into(), (3.0, 1.5));
        g.dead_letters = 2.0;
        let text = g.render();
        assert!(
            text.contains("# TYPE outbox_backlog_messages gauge"),
            "{text}"
        );
        assert!(
            text.contains("outbox_backlog_messages{destination=\"a\\\"b\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("outbox_oldest_pending_seconds{destination=\"a\\\"b\"} 1.5"),
            "{text}"
        );
        assert!(text.contains("outbox_dead_letter_messages 2"), "{text}");
        for name in DATABASE_WIDE {
            assert!(text.contains(&format!("# HELP {name} ")), "{name} has HELP");
        }
    }

    #[test]
    fn every_metric_has_help() {
        for name in ALL {
            assert!(!help(name).is_empty(), "{name} has no HELP text");
        }
    }
}
