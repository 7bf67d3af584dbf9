//! Operator commands: `status`, `dead-letters`, `locate`.
//!
//! Each reads the outbox schema directly, so it works whether or not a relay is
//! running, and prints either a human summary or `--json`.

use std::time::SystemTime;

use outbox_client::SchemaName;
use serde::Serialize;
use serde_json::json;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::Client;
use uuid::Uuid;

use crate::source::ownership::{LockKeys, PARTITIONS};

/// What went wrong in an operator command.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpsError {
    /// A database error.
    #[error("postgres: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    /// The operator declined, or could not be asked.
    #[error("{0}")]
    NotConfirmed(String),
    /// The selection is empty or unsafe.
    #[error("{0}")]
    Selection(String),
}

fn age_secs(t: Option<SystemTime>) -> Option<f64> {
    t.and_then(|t| SystemTime::now().duration_since(t).ok())
        .map(|d| d.as_secs_f64())
}

fn human_age(secs: Option<f64>) -> String {
    match secs {
        None => "-".into(),
        Some(s) if s < 120.0 => format!("{s:.0}s"),
        Some(s) if s < 7200.0 => format!("{:.0}m", s / 60.0),
        Some(s) => format!("{:.1}h", s / 3600.0),
    }
}

/// Retained published rows counted exactly up to this many.
const RETAINED_CAP: i64 = 100_000;

/// `outbox-relay status`: backlog, retries, dead letters, parked keys, replicas
/// and what holds the relay back.
pub async fn status(client: &Client, schema: &SchemaName) -> Result<serde_json::Value, OpsError> {
    let s = schema.quoted();
    let backlog = client
        .query(
            &format!(
                "SELECT destination, count(*), min(created_at), \
                        count(*) FILTER (WHERE attempts > 0) \
                 FROM {s}.messages GROUP BY destination ORDER BY count(*) DESC"
            ),
            &[],
        )
        .await?
        .iter()
        .map(|r| {
            let oldest: Option<SystemTime> = r.get(2);
            json!({
                "destination": r.get::<_, String>(0),
                "pending": r.get::<_, i64>(1),
                "oldest_at": at(oldest),
                "oldest_age_s": age_secs(oldest),
                "retrying": r.get::<_, i64>(3),
            })
        })
        .collect::<Vec<_>>();
    let dead: i64 = client
        .query_one(&format!("SELECT count(*) FROM {s}.dead_letters"), &[])
        .await?
        .get(0);
    // Retention mode only. Counting stops at RETAINED_CAP so status stays
    // quick on a week of retained rows; the oldest comes from the index.
    let retained = client
        .query_one(
            &format!(
                "SELECT (SELECT count(*) FROM (SELECT 1 FROM {s}.published LIMIT {RETAINED_CAP} + 1) c), \
                        (SELECT min(published_at) FROM {s}.published)"
            ),
            &[],
        )
        .await?;
    let retained_count: i64 = retained.get(0);
    let retained = json!({
        "count": retained_count.min(RETAINED_CAP),
        "at_least": retained_count > RETAINED_CAP,
        "oldest_at": at(retained.get(1)),
        "oldest_age_s": age_secs(retained.get(1)),
    });
    let parked = client
        .query(
            &format!(
                "SELECT d.ordering_key, min(d.message_id::text), count(DISTINCT m.seq) \
                 FROM {s}.dead_letters d JOIN {s}.messages m \
                   ON m.ordering_key = d.ordering_key AND m.seq > d.seq \
                 GROUP BY d.ordering_key ORDER BY 3 DESC LIMIT 50"
            ),
            &[],
        )
        .await?
        .iter()
        .map(|r| {
            json!({
                "key": r.get::<_, String>(0),
                "behind_dead_letter": r.get::<_, String>(1),
                "waiting": r.get::<_, i64>(2),
            })
        })
        .collect::<Vec<_>>();

    let paused = client
        .query(
            &format!(
                "SELECT p.destination, p.paused_at, p.reason, \
                        (SELECT count(*) FROM {s}.messages m WHERE m.destination = p.destination) \
                 FROM {s}.paused_destinations p ORDER BY p.paused_at"
            ),
            &[],
        )
        .await?
        .iter()
        .map(|r| {
            let since: SystemTime = r.get(1);
            json!({
                "destination": r.get::<_, String>(0),
                "paused_at": humantime::format_rfc3339_seconds(since).to_string(),
                "paused_for_s": age_secs(Some(since)),
                "reason": r.get::<_, Option<String>>(2),
                "waiting": r.get::<_, i64>(3),
            })
        })
        .collect::<Vec<_>>();

    let keys = LockKeys::fetch(client, schema).await?;
    let replicas = client
        .query(
            &format!(
                "WITH present AS ( \
                    SELECT objid::int AS slot, pid FROM pg_locks \
                    WHERE {held} AND classid::int8 = $1), \
                 owned AS ( \
                    SELECT pid, array_agg(objid::int ORDER BY objid) AS parts FROM pg_locks \
                    WHERE {held} AND classid::int8 = $2 \
                    GROUP BY pid) \
                 SELECT p.slot, r.host, r.pid, r.started_at, r.seen_at, r.in_flight, r.published, \
                        r.broker_down_since, r.broker_error, coalesce(o.parts, '{{}}'), \
                        (SELECT min(since) FROM {s}.partition_owners po WHERE po.slot = p.slot) \
                 FROM present p LEFT JOIN {s}.replicas r ON r.slot = p.slot \
                 LEFT JOIN owned o ON o.pid = p.pid ORDER BY r.started_at",
                held = crate::source::ownership::ADVISORY_HELD_HERE,
            ),
            &[&i64::from(keys.presence), &i64::from(keys.partitions)],
        )
        .await?
        .iter()
        .map(|r| {
            let parts: Vec<i32> = r.get(9);
            json!({
                "slot": r.get::<_, i32>(0),
                "host": r.get::<_, Option<String>>(1),
                "pid": r.get::<_, Option<i32>>(2),
                "started_at": at(r.get(3)),
                "started_age_s": age_secs(r.get(3)),
                "heartbeat_at": at(r.get(4)),
                "heartbeat_age_s": age_secs(r.get(4)),
                "in_flight": r.get::<_, Option<i32>>(5),
                "published": r.get::<_, Option<i64>>(6),
                "broker_down_since": at(r.get(7)),
                "broker_down_for_s": age_secs(r.get(7)),
                "broker_error": r.get::<_, Option<String>>(8),
                "partitions": parts,
                "owning_since": at(r.get(10)),
                "owning_since_age_s": age_secs(r.get(10)),
            })
        })
        .collect::<Vec<_>>();
    let owned_total: usize = replicas
        .iter()
        .map(|r| r["partitions"].as_array().map_or(0, |a| a.len()))
        .sum();
    let per_partition = client
        .query(
            &format!("SELECT partition, count(*) FROM {s}.messages GROUP BY 1 ORDER BY 1"),
            &[],
        )
        .await?
        .iter()
        .map(|r| json!({"partition": r.get::<_, i16>(0), "pending": r.get::<_, i64>(1)}))
        .collect::<Vec<_>>();

    // What holds the relay back.
    let mut blockers = Vec::new();
    for r in client
        .query(
            "SELECT pid, application_name, state, extract(epoch FROM now() - xact_start)::float8 \
             FROM pg_stat_activity \
             WHERE xact_start < now() - interval '10 seconds' AND pid <> pg_backend_pid() \
               AND datname = current_database() \
             ORDER BY xact_start LIMIT 5",
            &[],
        )
        .await?
    {
        blockers.push(json!({
            "kind": "long_transaction",
            "pid": r.get::<_, i32>(0),
            "application": r.get::<_, Option<String>>(1),
            "state": r.get::<_, Option<String>>(2),
            "age_s": r.get::<_, Option<f64>>(3),
            "why": "an open transaction holds back vacuum of published rows and hides rows it has not committed yet",
        }));
    }
    for r in &replicas {
        if let Some(down) = r["broker_down_for_s"].as_f64() {
            blockers.push(json!({
                "kind": "broker_unreachable",
                "slot": r["slot"],
                "down_since": r["broker_down_since"],
                "down_for_s": down,
                "error": r["broker_error"],
            }));
        }
    }
    if replicas.is_empty() && !backlog.is_empty() {
        blockers.push(json!({"kind": "no_relay", "why": "no relay replica is running"}));
    } else if !replicas.is_empty() && owned_total < PARTITIONS as usize {
        blockers.push(json!({
            "kind": "partitions_unowned",
            "unowned": PARTITIONS as usize - owned_total,
            "why": "some partitions have no owner yet (replicas starting or rebalancing)",
        }));
    }
    Ok(json!({
        "schema": schema.as_str(),
        "at": rfc3339(SystemTime::now()),
        "backlog": backlog,
        "in_flight": replicas.iter().filter_map(|r| r["in_flight"].as_i64()).sum::<i64>(),
        "dead_letters": dead,
        "published_retained": retained,
        "parked_keys": parked,
        "paused": paused,
        "replicas": replicas,
        "partitions_owned": owned_total,
        "partitions_total": PARTITIONS,
        "backlog_per_partition": per_partition,
        "blockers": blockers,
    }))
}

/// Renders [`status`] for a terminal.
pub fn status_text(v: &serde_json::Value) -> String {
    let mut o = String::new();
    let _ = writeln_str(
        &mut o,
        &format!("outbox schema {}", v["schema"].as_str().unwrap_or("?")),
    );
    let backlog = v["backlog"].as_array().cloned().unwrap_or_default();
    if backlog.is_empty() {
        let _ = writeln_str(&mut o, "backlog: empty");
    } else {
        let _ = writeln_str(&mut o, "backlog:");
        for b in backlog {
            let _ = writeln_str(
                &mut o,
                &format!(
                    "  {:<32} pending {:>8}  oldest {:>6}  retrying {}",
                    b["destination"].as_str().unwrap_or(""),
                    b["pending"],
                    human_age(b["oldest_age_s"].as_f64()),
                    b["retrying"]
                ),
            );
        }
    }
    let _ = writeln_str(&mut o, &format!("in flight: {}", v["in_flight"]));
    let _ = writeln_str(&mut o, &format!("dead letters: {}", v["dead_letters"]));
    let retained = &v["published_retained"];
    if retained["count"].as_i64().unwrap_or(0) > 0 {
        let _ = writeln_str(
            &mut o,
            &format!(
                "published, kept for retention: {}{} (oldest {})",
                retained["count"],
                if retained["at_least"].as_bool().unwrap_or(false) {
                    "+"
                } else {
                    ""
                },
                human_age(retained["oldest_age_s"].as_f64())
            ),
        );
    }
    for p in v["parked_keys"].as_array().cloned().unwrap_or_default() {
        let _ = writeln_str(
            &mut o,
            &format!(
                "  parked key {:?}: {} waiting behind {}",
                p["key"].as_str().unwrap_or(""),
                p["waiting"],
                p["behind_dead_letter"].as_str().unwrap_or("")
            ),
        );
    }
    for p in v["paused"].as_array().cloned().unwrap_or_default() {
        let _ = writeln_str(
            &mut o,
            &format!(
                "paused destination {:?} since {} ({} ago): {} waiting{}",
                p["destination"].as_str().unwrap_or(""),
                p["paused_at"].as_str().unwrap_or("?"),
                human_age(p["paused_for_s"].as_f64()),
                p["waiting"],
                p["reason"]
                    .as_str()
                    .map(|r| format!(" ({r})"))
                    .unwrap_or_default()
            ),
        );
    }
    let _ = writeln_str(
        &mut o,
        &format!(
            "replicas ({} of {} partitions owned):",
            v["partitions_owned"], v["partitions_total"]
        ),
    );
    for r in v["replicas"].as_array().cloned().unwrap_or_default() {
        let parts = r["partitions"].as_array().map_or(0, |a| a.len());
        let _ = writeln_str(
            &mut o,
            &format!(
                "  slot {} {}:{}  partitions {:>2} (since {})  in flight {}  published {}  heartbeat {}",
                r["slot"],
                r["host"].as_str().unwrap_or("?"),
                r["pid"],
                parts,
                human_age(r["owning_since_age_s"].as_f64()),
                r["in_flight"],
                r["published"],
                human_age(r["heartbeat_age_s"].as_f64()),
            ),
        );
    }
    let blockers = v["blockers"].as_array().cloned().unwrap_or_default();
    if blockers.is_empty() {
        let _ = writeln_str(&mut o, "holding back: nothing");
    } else {
        let _ = writeln_str(&mut o, "holding back:");
        for b in blockers {
            let line = match b["kind"].as_str() {
                Some("long_transaction") => format!(
                    "  transaction open {} in pid {} ({}, {}): {}",
                    human_age(b["age_s"].as_f64()),
                    b["pid"],
                    b["application"].as_str().unwrap_or(""),
                    b["state"].as_str().unwrap_or(""),
                    b["why"].as_str().unwrap_or("")
                ),
                Some("broker_unreachable") => format!(
                    "  broker unreachable for {} (replica {}): {}",
                    human_age(b["down_for_s"].as_f64()),
                    b["slot"],
                    b["error"].as_str().unwrap_or("")
                ),
                _ => format!("  {}", b["why"].as_str().unwrap_or("")),
            };
            let _ = writeln_str(&mut o, &line);
        }
    }
    o
}

fn writeln_str(o: &mut String, line: &str) -> std::fmt::Result {
    use std::fmt::Write as _;
    writeln!(o, "{line}")
}

/// Which dead letters a command acts on (the CLI's `--id`, `--key`,
/// `--destination`, `--since`, `--all`).
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only this message id.
    pub id: Option<Uuid>,
    /// Only this ordering key.
    pub key: Option<String>,
    /// Only this destination.
    pub destination: Option<String>,
    /// Only those dead-lettered at or after this time.
    pub since: Option<SystemTime>,
    /// Every dead letter (required by retry/discard when no other filter is given).
    pub all: bool,
}

impl Filter {
    fn is_empty(&self) -> bool {
        self.id.is_none()
            && self.key.is_none()
            && self.destination.is_none()
            && self.since.is_none()
    }

    fn sql(&self) -> (String, Vec<Box<dyn ToSql + Sync + Send>>) {
        let mut clauses = vec!["true".to_owned()];
        let mut params: Vec<Box<dyn ToSql + Sync + Send>> = Vec::new();
        if let Some(id) = self.id {
            params.push(Box::new(id));
            clauses.push(format!("message_id = ${}", params.len()));
        }
        if let Some(k) = &self.key {
            params.push(Box::new(k.clone()));
            clauses.push(format!("ordering_key = ${}", params.len()));
        }
        if let Some(d) = &self.destination {
            params.push(Box::new(d.clone()));
            clauses.push(format!("destination = ${}", params.len()));
        }
        if let Some(t) = self.since {
            params.push(Box::new(t));
            clauses.push(format!("dead_at >= ${}", params.len()));
        }
        (clauses.join(" AND "), params)
    }
}

#[derive(Debug, Serialize)]
struct DeadLetter {
    message_id: Uuid,
    seq: i64,
    destination: String,
    key: Option<String>,
    routing_key: String,
    attempts: i32,
    last_error: String,
    created_at: String,
    created_age_s: Option<f64>,
    dead_at: String,
    dead_age_s: Option<f64>,
    payload_bytes: usize,
    content_type: Option<String>,
    event_type: Option<String>,
    headers: serde_json::Value,
    /// The payload, only when asked for (`dead-letters show --payload`).
    #[serde(skip_serializing_if = "Option::is_none")]
    payload: Option<Payload>,
}

/// A payload as text when it is UTF-8, else as hex.
#[derive(Debug, Serialize)]
struct Payload {
    encoding: &'static str,
    data: String,
}

impl Payload {
    fn of(bytes: &[u8]) -> Payload {
        match std::str::from_utf8(bytes) {
            Ok(text) => Payload {
                encoding: "utf-8",
                data: text.to_owned(),
            },
            Err(_) => Payload {
                encoding: "hex",
                data: bytes.iter().map(|b| format!("{b:02x}")).collect(),
            },
        }
    }
}

/// `t` as RFC 3339 in UTC, for JSON beside the ages.
fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_micros(t).to_string()
}

/// [`rfc3339`] of a nullable column.
fn at(t: Option<SystemTime>) -> Option<String> {
    t.map(rfc3339)
}

/// A destination as an operator reads it: AMQP's default exchange has no name.
fn destination_name(d: &str) -> &str {
    if d.is_empty() {
        "(default exchange)"
    } else {
        d
    }
}

/// Dead letters matching `filter`, oldest seq first.
pub async fn dead_letters(
    client: &Client,
    schema: &SchemaName,
    filter: &Filter,
    limit: i64,
) -> Result<serde_json::Value, OpsError> {
    dead_letters_with(client, schema, filter, limit, false).await
}

/// [`dead_letters`], with each one's payload when `payload` is set.
pub async fn dead_letters_with(
    client: &Client,
    schema: &SchemaName,
    filter: &Filter,
    limit: i64,
    payload: bool,
) -> Result<serde_json::Value, OpsError> {
    let (wher, params) = filter.sql();
    let mut refs = as_refs(&params);
    refs.push(&limit);
    let rows = client
        .query(
            &format!(
                "SELECT message_id, seq, destination, ordering_key, routing_key, attempts, last_error, \
                        created_at, dead_at, length(payload), content_type, headers, event_type, \
                        CASE WHEN {payload} THEN payload END \
                 FROM {}.dead_letters WHERE {wher} ORDER BY seq LIMIT ${}",
                schema.quoted(),
                refs.len()
            ),
            &refs,
        )
        .await?;
    let list: Vec<DeadLetter> = rows
        .iter()
        .map(|r| DeadLetter {
            message_id: r.get(0),
            seq: r.get(1),
            destination: r.get(2),
            key: r.get(3),
            routing_key: r.get(4),
            attempts: r.get(5),
            last_error: r.get(6),
            created_at: rfc3339(r.get(7)),
            created_age_s: age_secs(r.get(7)),
            dead_at: rfc3339(r.get(8)),
            dead_age_s: age_secs(r.get(8)),
            payload_bytes: usize::try_from(r.get::<_, i32>(9)).unwrap_or(0),
            content_type: r.get(10),
            headers: r.get(11),
            event_type: r.get(12),
            payload: r.get::<_, Option<&[u8]>>(13).map(Payload::of),
        })
        .collect();
    Ok(serde_json::to_value(list).unwrap_or_default())
}

/// Renders a dead-letter list for a terminal.
pub fn dead_letters_text(v: &serde_json::Value, detailed: bool) -> String {
    let mut o = String::new();
    let list = v.as_array().cloned().unwrap_or_default();
    if list.is_empty() {
        let _ = writeln_str(&mut o, "no dead letters match");
    }
    for d in list {
        let _ = writeln_str(
            &mut o,
            &format!(
                "{}  {}  key={}  attempts={}  dead {} ago  error: {}",
                d["message_id"].as_str().unwrap_or(""),
                destination_name(d["destination"].as_str().unwrap_or("")),
                d["key"].as_str().unwrap_or("-"),
                d["attempts"],
                human_age(d["dead_age_s"].as_f64()),
                d["last_error"].as_str().unwrap_or("")
            ),
        );
        if detailed {
            let _ = writeln_str(
                &mut o,
                &format!(
                    "    seq {}  routing key {:?}  content type {}  payload {} bytes  written {} ago\n    headers {}",
                    d["seq"],
                    d["routing_key"].as_str().unwrap_or(""),
                    d["content_type"].as_str().unwrap_or("-"),
                    d["payload_bytes"],
                    human_age(d["created_age_s"].as_f64()),
                    d["headers"]
                ),
            );
            if let Some(p) = d["payload"].as_object() {
                let _ = writeln_str(
                    &mut o,
                    &format!(
                        "    payload ({}): {}",
                        p["encoding"].as_str().unwrap_or(""),
                        p["data"].as_str().unwrap_or("")
                    ),
                );
            }
        }
    }
    o
}

/// Borrows boxed parameters in the form `execute` takes.
fn as_refs(params: &[Box<dyn ToSql + Sync + Send>]) -> Vec<&(dyn ToSql + Sync)> {
    params
        .iter()
        .map(|p| p.as_ref() as &(dyn ToSql + Sync))
        .collect()
}

/// Refuses retry/discard without an explicit selection.
pub fn require_selection(filter: &Filter) -> Result<(), OpsError> {
    if filter.is_empty() && !filter.all {
        return Err(OpsError::Selection(
            "select dead letters with --id, --key, --destination or --since, or pass --all".into(),
        ));
    }
    Ok(())
}

/// Returns matching dead letters to the outbox with their original seq (so they
/// keep their place in their key's order) and a fresh attempt count. Their keys
/// unpark as the dead letters leave. Returns how many moved.
pub async fn retry(client: &Client, schema: &SchemaName, filter: &Filter) -> Result<u64, OpsError> {
    require_selection(filter)?;
    let (wher, params) = filter.sql();
    let refs = as_refs(&params);
    let s = schema.quoted();
    // One statement: the move is atomic without an explicit transaction.
    let moved = client
        .execute(
            &format!(
                "WITH moved AS (DELETE FROM {s}.dead_letters WHERE {wher} RETURNING *), \
                 {unhold} \
                 INSERT INTO {s}.messages (seq, message_id, destination, ordering_key, routing_key, \
                                           headers, payload, content_type, event_type, created_at, last_error) \
                 OVERRIDING SYSTEM VALUE \
                 SELECT seq, message_id, destination, ordering_key, routing_key, headers, payload, \
                        content_type, event_type, created_at, 'retried from dead letters: ' || last_error \
                 FROM moved ORDER BY seq",
                unhold = unhold_keys_of(&s, "moved"),
            ),
            &refs,
        )
        .await
        .map_err(|e| {
            if e.code() == Some(&SqlState::UNIQUE_VIOLATION) {
                OpsError::Selection("a selected message is already back in the outbox".into())
            } else {
                OpsError::Postgres(e)
            }
        })?;
    Ok(moved)
}

/// Pauses `destination` for every replica: its rows wait in the outbox, not
/// claimed and not counted as attempts, until [`resume`]; a key with a
/// message for it waits there too, so order per key holds. Batches already
/// claimed finish; each replica's next claim honours the pause. Returns false
/// when it was already paused (its reason is updated when one is given).
pub async fn pause(
    client: &Client,
    schema: &SchemaName,
    destination: &str,
    reason: Option<&str>,
) -> Result<bool, OpsError> {
    let row = client
        .query_one(
            &format!(
                "INSERT INTO {s}.paused_destinations AS p (destination, reason) VALUES ($1, $2) \
                 ON CONFLICT (destination) DO UPDATE SET reason = coalesce(EXCLUDED.reason, p.reason) \
                 RETURNING (xmax = 0)",
                s = schema.quoted()
            ),
            &[&destination, &reason],
        )
        .await?;
    Ok(row.get(0))
}

/// Resumes a paused destination: its rows, and the rows of keys set aside
/// behind them, are ready at once. Returns how many rows were brought back.
pub async fn resume(
    client: &Client,
    schema: &SchemaName,
    destination: &str,
) -> Result<u64, OpsError> {
    let s = schema.quoted();
    let row = client
        .query_one(
            &format!(
                "WITH gone AS (DELETE FROM {s}.paused_destinations WHERE destination = $1 RETURNING 1), \
                 back AS ( \
                    UPDATE {s}.messages SET next_attempt_at = '-infinity' \
                    WHERE EXISTS (SELECT 1 FROM gone) AND next_attempt_at > now() \
                      AND (destination = $1 OR (attempts = 0 AND ordering_key IN ( \
                            SELECT ordering_key FROM {s}.messages \
                            WHERE destination = $1 AND ordering_key IS NOT NULL))) \
                    RETURNING 1) \
                 SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM back)"
            ),
            &[&destination],
        )
        .await?;
    if row.get::<_, i64>(0) == 0 {
        return Err(OpsError::Selection(format!(
            "destination {destination:?} is not paused"
        )));
    }
    Ok(u64::try_from(row.get::<_, i64>(1)).unwrap_or(0))
}

/// Deletes matching dead letters for good. Returns how many.
pub async fn discard(
    client: &Client,
    schema: &SchemaName,
    filter: &Filter,
) -> Result<u64, OpsError> {
    require_selection(filter)?;
    let (wher, params) = filter.sql();
    let refs = as_refs(&params);
    let s = schema.quoted();
    let row = client
        .query_one(
            &format!(
                "WITH gone AS (DELETE FROM {s}.dead_letters WHERE {wher} RETURNING ordering_key), \
                 {unhold} \
                 SELECT count(*) FROM gone",
                unhold = unhold_keys_of(&s, "gone"),
            ),
            &refs,
        )
        .await?;
    Ok(u64::try_from(row.get::<_, i64>(0)).unwrap_or(0))
}

/// A CTE named `unheld` that brings back the rows a claim set aside behind
/// the dead letters in CTE `source` (rows never refused themselves, waiting
/// behind their key's head), so the key flows again at once rather than at
/// the next recheck. Safe however it races: the claim's head-of-key rule
/// still holds back any row whose older rows remain.
fn unhold_keys_of(schema: &str, source: &str) -> String {
    format!(
        "unheld AS (UPDATE {schema}.messages SET next_attempt_at = '-infinity' \
           WHERE ordering_key IN (SELECT ordering_key FROM {source} WHERE ordering_key IS NOT NULL) \
             AND attempts = 0 AND next_attempt_at > '-infinity' RETURNING 1)"
    )
}

/// Where message `id` is: pending (with its attempts and error), in flight,
/// dead-lettered (why), or not in the outbox (published and deleted, or never
/// enqueued: rows are deleted on confirm).
pub async fn locate(
    client: &mut Client,
    schema: &SchemaName,
    id: Uuid,
) -> Result<serde_json::Value, OpsError> {
    let s = schema.quoted();
    let tx = client.transaction().await?;
    // Probe the row lock without waiting: a relay holding it is publishing it.
    let probe = tx
        .query_opt(
            &format!(
                "SELECT seq, destination, ordering_key, attempts, last_error, created_at, \
                        last_attempt_at, next_attempt_at, partition \
                 FROM {s}.messages WHERE message_id = $1 FOR UPDATE NOWAIT"
            ),
            &[&id],
        )
        .await;
    let found = match probe {
        Ok(Some(r)) => {
            let next: SystemTime = r.get(7);
            Some(json!({
                "state": match (r.get::<_, i32>(3), next > SystemTime::now()) {
                    (0, true) => "held",
                    (0, false) => "pending",
                    _ => "retrying",
                },
                "seq": r.get::<_, i64>(0),
                "destination": r.get::<_, String>(1),
                "key": r.get::<_, Option<String>>(2),
                "attempts": r.get::<_, i32>(3),
                "last_error": r.get::<_, Option<String>>(4),
                "created_at": at(r.get(5)),
                "age_s": age_secs(r.get(5)),
                "last_attempt_at": at(r.get(6)),
                "last_attempt_age_s": age_secs(r.get(6)),
                "next_attempt_at": rfc3339(next),
                "next_attempt_in_s": next.duration_since(SystemTime::now()).ok().map(|d| d.as_secs_f64()),
                "partition": r.get::<_, i16>(8),
            }))
        }
        Ok(None) => None,
        Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => Some(
            json!({"state": "in_flight", "why": "a relay holds it while the broker confirms it"}),
        ),
        Err(e) => return Err(e.into()),
    };
    // What holds a waiting message back, when something does: its
    // destination is paused, or an older message of its key is a dead
    // letter (the key is parked until that one is retried or discarded).
    let found = match found {
        Some(mut v) if v["seq"].is_i64() => {
            let seq = v["seq"].as_i64().unwrap_or(0);
            let destination = v["destination"].as_str().unwrap_or("").to_owned();
            let key = v["key"].as_str().map(str::to_owned);
            let paused = tx
                .query_opt(
                    &format!("SELECT paused_at, reason FROM {s}.paused_destinations WHERE destination = $1"),
                    &[&destination],
                )
                .await?;
            let blocker = match &key {
                Some(k) => tx
                    .query_opt(
                        &format!(
                            "SELECT message_id::text FROM {s}.dead_letters \
                             WHERE ordering_key = $1 AND seq < $2 ORDER BY seq LIMIT 1"
                        ),
                        &[k, &seq],
                    )
                    .await?
                    .map(|r| r.get::<_, String>(0)),
                None => None,
            };
            if let Some(p) = paused {
                v["state"] = json!("paused");
                v["why"] = json!(format!(
                    "its destination is paused{} (outbox-relay resume {destination:?})",
                    p.get::<_, Option<String>>(1)
                        .map(|r| format!(": {r}"))
                        .unwrap_or_default()
                ));
            } else if let Some(dead) = blocker {
                v["state"] = json!("parked");
                v["behind_dead_letter"] = json!(dead);
                v["why"] = json!(format!(
                    "parked behind dead letter {dead} of its key (outbox-relay dead-letters retry|discard --id {dead})"
                ));
            }
            Some(v)
        }
        other => other,
    };
    drop(tx);
    if let Some(v) = found {
        return Ok(with_id(v, id));
    }
    if let Some(r) = client
        .query_opt(
            &format!(
                "SELECT destination, ordering_key, attempts, last_error, dead_at FROM {s}.dead_letters \
                 WHERE message_id = $1"
            ),
            &[&id],
        )
        .await?
    {
        return Ok(with_id(
            json!({
                "state": "dead_lettered",
                "destination": r.get::<_, String>(0),
                "key": r.get::<_, Option<String>>(1),
                "attempts": r.get::<_, i32>(2),
                "last_error": r.get::<_, String>(3),
                "dead_at": at(r.get(4)),
                "dead_age_s": age_secs(r.get(4)),
            }),
            id,
        ));
    }
    // Retention mode keeps published rows; the newest wins if an id was reused.
    if let Some(r) = client
        .query_opt(
            &format!(
                "SELECT destination, ordering_key, attempts, published_at, receipt FROM {s}.published \
                 WHERE message_id = $1 ORDER BY published_at DESC LIMIT 1"
            ),
            &[&id],
        )
        .await?
    {
        let published_at: SystemTime = r.get(3);
        return Ok(with_id(
            json!({
                "state": "published",
                "destination": r.get::<_, String>(0),
                "key": r.get::<_, Option<String>>(1),
                "attempts": r.get::<_, i32>(2),
                "published_at": humantime::format_rfc3339_millis(published_at).to_string(),
                "published_age_s": age_secs(Some(published_at)),
                "receipt": r.get::<_, serde_json::Value>(4),
            }),
            id,
        ));
    }
    Ok(with_id(
        json!({
            "state": "unknown",
            "why": "not in the outbox, the dead letters or the retained published rows: published and deleted (without --retention, rows go once the broker confirms), or never committed",
        }),
        id,
    ))
}

/// "kafka partition 3 offset 17" or "rabbitmq confirm ack (exchange ...)".
fn receipt_text(r: &serde_json::Value) -> String {
    match r["broker"].as_str() {
        Some("kafka") => format!(
            "kafka topic {:?} partition {} offset {}",
            r["topic"].as_str().unwrap_or(""),
            r["partition"],
            r["offset"]
        ),
        Some("rabbitmq") => format!(
            "rabbitmq confirm {} (exchange {:?}, routing key {:?})",
            r["confirm"].as_str().unwrap_or(""),
            r["exchange"].as_str().unwrap_or(""),
            r["routing_key"].as_str().unwrap_or("")
        ),
        _ => r.to_string(),
    }
}

fn with_id(mut v: serde_json::Value, id: Uuid) -> serde_json::Value {
    v["message_id"] = json!(id.to_string());
    v
}

/// Renders [`locate`] for a terminal.
pub fn locate_text(v: &serde_json::Value) -> String {
    let id = v["message_id"].as_str().unwrap_or("");
    match v["state"].as_str() {
        Some("pending") | Some("retrying") | Some("held") | Some("parked") | Some("paused") => {
            format!(
                "{id}: {} to {:?} (key {}), {} failed attempts{}; written {} ago{}\n",
                v["state"].as_str().unwrap_or(""),
                v["destination"].as_str().unwrap_or(""),
                v["key"].as_str().unwrap_or("-"),
                v["attempts"],
                v["last_error"]
                    .as_str()
                    .map(|e| format!(", last error: {e}"))
                    .unwrap_or_default(),
                human_age(v["age_s"].as_f64()),
                v["why"]
                    .as_str()
                    .map(|w| format!("; {w}"))
                    .unwrap_or_default(),
            )
        }
        Some("in_flight") => format!("{id}: in flight: {}\n", v["why"].as_str().unwrap_or("")),
        Some("dead_lettered") => format!(
            "{id}: dead-lettered {} ago after {} attempts: {}\n",
            human_age(v["dead_age_s"].as_f64()),
            v["attempts"],
            v["last_error"].as_str().unwrap_or("")
        ),
        Some("published") => format!(
            "{id}: published to {:?} (key {}) at {} ({} ago), receipt {}\n",
            v["destination"].as_str().unwrap_or(""),
            v["key"].as_str().unwrap_or("-"),
            v["published_at"].as_str().unwrap_or(""),
            human_age(v["published_age_s"].as_f64()),
            receipt_text(&v["receipt"]),
        ),
        _ => format!("{id}: unknown: {}\n", v["why"].as_str().unwrap_or("")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_show_as_text_when_utf8_else_as_hex() {
        let p = Payload::of("é {}".as_bytes());
        assert_eq!((p.encoding, p.data.as_str()), ("utf-8", "é {}"));
        let p = Payload::of(&[0xff, 0x00, 0x10]);
        assert_eq!((p.encoding, p.data.as_str()), ("hex", "ff0010"));
        assert_eq!(destination_name(""), "(default exchange)");
        assert_eq!(destination_name("orders"), "orders");
    }
}
